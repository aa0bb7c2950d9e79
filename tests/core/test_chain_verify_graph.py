"""Causal-chain verify graph families (``GraphState(chain=True)``, vLLM's spec-decode verify) on CPU:
the chain mask, the family's refresh from a device block table against the float32 reference, the
refusal of a tree mask, the provider's ``chain_graph_cls`` dispatch, and the flashinfer provider's chain
part (a fake FlashInfer records what it is asked): a causal ``use_cuda_graph`` prefill wrapper over the
static buffers, re-planned from host lengths and the device ``kv_indices``."""

from __future__ import annotations

import types

import pytest
import torch
from batches import chain_batch, rel_err

from attnplug.core import AttentionConfig, BatchMetadata, UnsupportedFeature
from attnplug.core.cuda_graph import GraphState, chain_mask
from attnplug.core.plan import make_plan
from attnplug.core.providers.flashinfer import FlashInferChainVerifyGraph, FlashInferGraph, FlashInferProvider
from attnplug.core.reference import reference_attention

Q, MAX_BS, W, NUM_PAGES = 3, 4, 6, 40
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # triton compiled on a GPU, interpreted on CPU
CFG = AttentionConfig(4, 2, 32, 4, torch.float32)


def test_chain_mask_rows_see_the_prefix_and_earlier_drafts():
    m = chain_mask(3, 5)  # 2 committed tokens + 3 drafts
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def _batch(B, seed):
    return chain_batch(CFG, B, Q, W, NUM_PAGES, torch.Generator().manual_seed(seed), max_prefix=14)


def _state(provider="triton"):
    return GraphState(
        CFG,
        provider,
        MAX_BS,
        MAX_BS * Q,
        NUM_PAGES,
        DEV,
        "verify",
        num_draft_tokens=Q,
        pad_page=0,
        max_seq_len=W * CFG.page_size,
        chain=True,
    )


@pytest.mark.parametrize("B,bs", [(3, 3), (2, 4), (1, 2)])
def test_chain_family_from_block_table_matches_reference(B, bs):
    gs = _state()
    assert gs.chain
    gs.prepare_capture(bs)
    seq, table, batch = _batch(B, seed=B * 10 + bs)
    gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs)  # rows B..bs-1: padding
    g = torch.Generator().manual_seed(1)
    k = torch.randn(CFG.kv_cache_shape(NUM_PAGES), generator=g).to(DEV)
    v = torch.randn(CFG.kv_cache_shape(NUM_PAGES), generator=g).to(DEV)
    q = torch.randn(bs * Q, CFG.num_qo_heads, CFG.head_dim, generator=g).to(DEV)
    out = torch.full_like(q, float("nan"))
    gs.run(bs, q, k, v, out)
    ref, _ = reference_attention(make_plan(CFG, batch, NUM_PAGES, device=DEV), q[: B * Q], k, v)
    assert not torch.isnan(out).any()
    assert rel_err(out[: B * Q], ref) <= 1e-4
    # the host path with the same chain mask writes the same buffers and output
    out2 = torch.full_like(q, float("nan"))
    gs.update(batch, bs)
    gs.run(bs, q, k, v, out2)
    assert rel_err(out2[: B * Q], ref) <= 1e-4


def test_chain_family_refuses_a_tree_mask_on_the_host():
    gs = _state()
    gs.prepare_capture(2)
    _, _, batch = _batch(2, seed=3)
    tree = batch.custom_mask.clone()
    tree[-1] = False  # the last draft of the last request no longer sees itself: not a chain
    bad = BatchMetadata(
        batch.mode, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, custom_mask=tree
    )
    with pytest.raises(UnsupportedFeature, match="attnplug.*'triton'.*chain=True.*tree mask for request 1"):
        gs.update(bad, 2)
    gs.update(batch, 2)  # the chain itself passes


class _FakeWrapper:
    def __init__(self, workspace, layout, **kw):
        self.init, self.plans = kw, []

    def plan(self, *args, **kw):
        self.plans.append((args, kw))


def _fake_flashinfer_provider():
    """A FlashInfer provider over a recording fake library, on DEV (the graph update kernel runs there): only
    what the graph parts touch."""
    p = FlashInferProvider.__new__(FlashInferProvider)
    p.config, p.device = CFG16, torch.device(DEV)
    p._fi = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper, BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper
    )
    p._workspace, p._wrappers, p.default_backend = torch.zeros(8, dtype=torch.uint8, device=DEV), {}, "fa3"
    p.resolve_backend = lambda backend: backend  # no CUDA capability to read here
    return p


CFG16 = AttentionConfig(4, 2, 64, 4, torch.bfloat16)


def test_flashinfer_chain_family_plans_causal_from_host_lengths_and_device_indices():
    p = _fake_flashinfer_provider()
    gs = GraphState(
        CFG16,
        p,
        MAX_BS,
        MAX_BS * Q,
        NUM_PAGES,
        DEV,
        "verify",
        num_draft_tokens=Q,
        pad_page=0,
        max_seq_len=W * CFG16.page_size,
        chain=True,
    )
    assert isinstance(gs.graph, FlashInferChainVerifyGraph) and gs.needs_host_lengths
    bs, B = 3, 2
    gs.prepare_capture(bs)
    wr = gs.graph.wrappers[bs]
    assert wr.init["use_cuda_graph"] and wr.init["backend"] == "fa2" and "custom_mask_buf" not in wr.init
    assert wr.init["paged_kv_indices_buf"] is gs.kv_indices
    with pytest.raises(UnsupportedFeature, match="flashinfer.*without host sequence lengths"):
        gs.update_from_block_table(
            torch.tensor([7, 9], dtype=torch.int32, device=DEV), torch.ones(2, W, dtype=torch.int32, device=DEV), bs
        )
    seq, table, _ = _batch(B, seed=5)
    gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs, host_seq_lens=seq)
    args, kw = wr.plans[-1]
    qo, ind, idx, last = args[:4]
    P = CFG16.page_size
    kv = seq.tolist() + [1 + Q]  # the padded request: FILL_SEQ_LEN + q
    npg = [-(-x // P) for x in kv]
    assert kw["causal"] is True and "custom_mask" not in kw
    assert all(t.device.type == "cpu" for t in (qo, ind, last))
    assert qo.tolist() == [0, Q, 2 * Q, 3 * Q]
    assert ind.tolist() == torch.tensor([0] + npg).cumsum(0).tolist()
    assert last.tolist() == [(x - 1) % P + 1 for x in kv]
    assert idx.data_ptr() == gs.kv_indices.data_ptr() and idx.numel() == sum(npg)  # the device buffer: no copy
    assert idx[: npg[0]].tolist() == table[0, : npg[0]].tolist()
    assert args[4:8] == (4, 2, 64, 4) and kw["sm_scale"] == CFG16.scale


def test_flashinfer_tree_family_keeps_the_custom_mask_path():
    p = _fake_flashinfer_provider()
    gs = GraphState(CFG16, p, MAX_BS, MAX_BS * Q, NUM_PAGES, DEV, "verify", num_draft_tokens=Q, pad_page=0)
    assert type(gs.graph) is FlashInferGraph and not gs.chain
    gs.prepare_capture(2)
    with pytest.raises(UnsupportedFeature, match="flashinfer.*verify mode"):
        gs.update_from_block_table(
            torch.tensor([7], dtype=torch.int32, device=DEV),
            torch.ones(1, W, dtype=torch.int32, device=DEV),
            2,
            host_seq_lens=torch.tensor([7], dtype=torch.int32),
        )
