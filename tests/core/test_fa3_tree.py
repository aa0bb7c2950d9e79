"""The fa3 provider's tree-verify split (FA3 on the prefix + Triton on the draft keys, LSE-merged),
checked with a stand-in for the FA3 call (the real one runs in tests/gpu on an H200): on CPU under
the Triton interpreter, on a CUDA machine with the compiled Triton kernel."""

from __future__ import annotations

import math

import fa3_standin
import pytest
import torch
from batches import random_case, rel_err

from attnplug.core import AttentionConfig, ForwardMode, UnsupportedFeature, make_plan
from attnplug.core.providers.fa3 import FA3Provider
from attnplug.core.reference import reference_attention

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # conftest: interpreter without CUDA


def fa3_on_cpu(cfg: AttentionConfig) -> FA3Provider:
    return fa3_standin.fa3_on_cpu(cfg, DEV)


@pytest.mark.parametrize("page", [1, 16])
def test_tree_verify_split_equals_reference(page):
    cfg = AttentionConfig(8, 2, 64, page, torch.bfloat16)
    c = random_case(ForwardMode.TARGET_VERIFY, [6, 4, 9], [33, 0, 17], cfg, device=DEV, seed=page)  # one empty prefix
    plan = make_plan(cfg, c.batch, num_pages=c.num_pages, device=DEV)
    prov = fa3_on_cpu(cfg)
    prov.plan(plan)
    out = torch.full_like(c.q, math.nan)
    lse = torch.full((c.q.shape[0], cfg.num_qo_heads), math.nan, device=DEV)
    prov.run(plan, c.q, c.k_cache, c.v_cache, out, lse)
    ref, ref_lse = reference_attention(plan, c.q, c.k_cache, c.v_cache)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= 1e-2
    assert rel_err(lse, ref_lse) <= 1e-4
    # FA3 reads each request's mask-free columns (the prefix, and the draft keys every query sees: here
    # the tree's root), the Triton tree part the rest; both are the plan's device mask_free, no copy
    tree, free = plan.state.tree, plan.mask_free_cpu.tolist()
    assert all(f >= p for f, p in zip(free, [33, 0, 17])) and free != [33, 0, 17]
    assert tree.tree_plan.options.kv_start is plan.mask_free and plan.state.args.seqused_k is plan.mask_free
    assert plan.state.args.max_seqlen_k == max(free)


def test_tree_mask_hiding_prefix_is_refused():
    cfg = AttentionConfig(4, 2, 64, 16, torch.bfloat16)
    c = random_case(ForwardMode.TARGET_VERIFY, [4], [10], cfg, seed=1, mask_kind="random")
    c.batch.custom_mask[0] = False  # row 0 hides prefix key 0
    plan = make_plan(cfg, c.batch, num_pages=c.num_pages)
    with pytest.raises(
        UnsupportedFeature, match="provider 'fa3' does not support a tree mask that hides part of the prefix"
    ):
        fa3_on_cpu(cfg).plan(plan)


@pytest.mark.parametrize("page", [1, 16])
def test_tree_verify_graph_state_replay_equals_reference(page):
    """The fa3 provider's verify under a GraphState (the CUDA-graph path: static buffers, padded
    batches, in-place updates): prefix through the FA3 stand-in on the static block table and
    ``seqused_k = mask_free``, tree part through the Triton kernel on static tiles, LSE-merged. Both
    update paths: a tree mask (``update``) and vLLM's chain mask (``update_from_block_table``)."""
    from attnplug.core import BatchMetadata
    from attnplug.core.cuda_graph import GraphState

    cfg, q, max_bs, pad_page = AttentionConfig(8, 2, 64, page, torch.bfloat16), 4, 3, 0
    gs = GraphState(
        cfg,
        fa3_on_cpu(cfg),
        max_batch=max_bs,
        max_tokens=max_bs * q,
        max_pages=400,
        device=DEV,
        mode="verify",
        num_draft_tokens=q,
        pad_page=pad_page,
        max_seq_len=200,
    )
    plans = {bs: gs.prepare_capture(bs) for bs in range(1, max_bs + 1)}
    for bs, B, seed in ((3, 2, 1), (3, 3, 2), (1, 1, 3), (2, 1, 4)):
        c = random_case(ForwardMode.TARGET_VERIFY, [q] * B, [40 + 9 * seed, 3, 77][:B], cfg, device=DEV, seed=seed)
        k, v = c.k_cache, c.v_cache  # padded requests read pad_page (a page of some request here: read only)
        assert gs.update(c.batch, bs) is plans[bs]
        qpad = torch.cat([c.q, torch.randn(bs * q - B * q, *c.q.shape[1:]).to(c.q)])
        out = torch.full_like(qpad, math.nan)
        gs.run(bs, qpad, k, v, out)
        ref, _ = reference_attention(make_plan(cfg, c.batch, c.num_pages, device=DEV), c.q, k, v)
        assert rel_err(out[: B * q], ref) <= 1e-2, f"bs={bs} B={B}"
        assert torch.isfinite(out[B * q :]).all()
    # vLLM's chain mask from a device block table
    B, bs = 2, 3
    seq = torch.tensor([50, 9], dtype=torch.int32)
    W = -(-60 // page)
    table = (torch.randperm(2 * W) + 1).view(2, W).to(torch.int32)
    gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs)
    mask = torch.cat(
        [torch.tensor([[col <= s - q + i for col in range(s)] for i in range(q)]).flatten() for s in seq.tolist()]
    )
    batch = BatchMetadata.from_block_table(
        ForwardMode.TARGET_VERIFY, torch.arange(B + 1, dtype=torch.int32) * q, table, seq, page, custom_mask=mask
    )
    g = torch.Generator().manual_seed(9)
    kv_shape = cfg.kv_cache_shape(2 * W + 1)
    k, v = (torch.randn(kv_shape, generator=g).to(cfg.dtype).to(DEV) for _ in range(2))
    qpad = torch.randn(bs * q, 8, 64, generator=g).to(cfg.dtype).to(DEV)
    out = torch.full_like(qpad, math.nan)
    gs.run(bs, qpad, k, v, out)
    ref, _ = reference_attention(make_plan(cfg, batch, 2 * W + 1, device=DEV), qpad[: B * q], k, v)
    assert rel_err(out[: B * q], ref) <= 1e-2


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0], [2], []])
def test_gather_block_table_matches_the_csr(counts):
    """FA3's block table gathered from the CSR on the device (no sync): each row's own pages in order,
    every other entry a valid page id (FA3 reads only the first ceil(seqused_k / P) of a row)."""
    from attnplug.core.page_table import block_table_from_csr
    from attnplug.core.providers.fa3 import gather_block_table

    g = torch.Generator().manual_seed(len(counts))
    nnz, P = sum(counts), 4
    kv_indices = torch.randperm(50, generator=g)[:nnz].to(torch.int32)
    kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([P if c else 0 for c in counts], dtype=torch.int32)
    W = max(counts + [1]) + 2
    want, _ = block_table_from_csr(kv_indptr, kv_indices, last, P, W)
    got = gather_block_table(
        kv_indptr.to(DEV), kv_indices.to(DEV), torch.arange(W, dtype=torch.int32, device=DEV)
    ).cpu()
    assert got.shape == (len(counts), W) and got.dtype == torch.int32
    for b, c in enumerate(counts):
        assert got[b, :c].tolist() == want[b, :c].tolist(), b
    valid = set(kv_indices.tolist()) or {0}
    assert set(got.flatten().tolist()) <= valid
