"""CUDA-graph replay of causal-chain verify families (``GraphState(chain=True)``: vLLM's spec-decode
verify, ``q = 1 + k`` tokens a request) refreshed from a device block table, as vLLM's builder drives
them (``update_from_block_table`` with host lengths, for FlashInfer's host re-plan), for every provider,
bs 1..MAX_BS with padding rows, against the float32 reference of the unpadded batch with the chain mask.
Without CUDA: skipped. A provider that cannot load FAILS (``ATTNPLUG_GPU_OPTIONAL_PROVIDERS``)."""

from __future__ import annotations

import pytest
import torch
from batches import assert_close_per_request_head, chain_batch
from gpu_expectations import provider_unavailable, unexpected_refusal

from attnplug.core import AttentionConfig, ProviderUnavailable, UnsupportedFeature
from attnplug.core.cuda_graph import GraphState
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

CUDA = torch.cuda.is_available()
PROVIDERS = ["triton", "fa3", "flashinfer"]
MAX_BS, Q, W = 4, 5, 16  # Q: 1 + 4 n-gram tokens; W: block-table width (pages)
CFG = AttentionConfig(8, 2, 128, 16, torch.bfloat16)
NUM_PAGES = 256  # page 0 is the pad page (vLLM's null block)


def _batch(B, g):
    return chain_batch(CFG, B, Q, W, NUM_PAGES, g)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS + ["flashinfer@fa3"])
def test_chain_verify_graphs_from_device_block_table(provider, monkeypatch):
    """``flashinfer@fa3``: the chain family on FlashInfer's sm90 template (``ATTNPLUG_FLASHINFER_BACKEND=fa3``)."""
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    if provider.endswith("@fa3"):
        monkeypatch.setenv("ATTNPLUG_FLASHINFER_BACKEND", "fa3")
        provider = provider.removesuffix("@fa3")
    try:
        gs = GraphState(
            CFG,
            provider,
            MAX_BS,
            MAX_BS * Q,
            NUM_PAGES,
            "cuda",
            "verify",
            num_draft_tokens=Q,
            pad_page=0,
            max_seq_len=W * CFG.page_size,
            chain=True,
        )
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    except UnsupportedFeature as e:
        unexpected_refusal((provider, "chain verify"), e)
    g = torch.Generator().manual_seed(0)
    shape = CFG.kv_cache_shape(NUM_PAGES)
    k = torch.randn(shape, generator=g).to(CFG.dtype).cuda()
    v = torch.randn(shape, generator=g).to(CFG.dtype).cuda()
    q_static = torch.zeros(MAX_BS * Q, CFG.num_qo_heads, CFG.head_dim, dtype=CFG.dtype, device="cuda")
    out_static = torch.zeros_like(q_static)
    seq_buf = torch.zeros(MAX_BS, dtype=torch.int32, device="cuda")  # vLLM's persistent buffers
    table_buf = torch.zeros(MAX_BS, W, dtype=torch.int32, device="cuda")
    graphs = {}
    for bs in range(1, MAX_BS + 1):
        gs.prepare_capture(bs)
        seq, table, _ = _batch(bs, g)
        seq_buf[:bs].copy_(seq)
        table_buf[:bs].copy_(table)
        gs.update_from_block_table(seq_buf[:bs], table_buf[:bs], bs, host_seq_lens=seq)
        n = bs * Q
        gs.run(bs, q_static[:n], k, v, out_static[:n])  # warm-up outside capture
        torch.cuda.synchronize()
        graphs[bs] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bs]):
            gs.run(bs, q_static[:n], k, v, out_static[:n])
    for bs in range(1, MAX_BS + 1):
        for B in sorted({bs, max(1, bs - 1), 1}):
            seq, table, batch = _batch(B, g)
            seq_buf.zero_()  # rows B..bs-1: vLLM's padding rows (seq_len 0)
            seq_buf[:B].copy_(seq)
            table_buf[:B].copy_(table)
            gs.update_from_block_table(
                seq_buf[:bs], table_buf[:bs], bs, host_seq_lens=torch.cat([seq, torch.zeros(bs - B, dtype=torch.int32)])
            )
            q = torch.randn(B * Q, CFG.num_qo_heads, CFG.head_dim, generator=g).to(CFG.dtype).cuda()
            q_static[: B * Q].copy_(q)
            out_static.fill_(float("nan"))
            graphs[bs].replay()
            oracle, _ = reference_attention(make_plan(CFG, batch, NUM_PAGES, device="cuda"), q, k, v)
            torch.cuda.synchronize()
            got = out_static[: B * Q]
            assert not torch.isnan(got).any(), f"{provider} bs={bs} B={B}: NaN"
            assert_close_per_request_head(got, oracle, batch.qo_indptr, CFG.dtype, f"{provider} chain bs={bs} B={B}")
