"""Cascade (shared-prefix) attention through every provider on the GPU, against the float32
reference of the whole batch (skipped with a reason without CUDA; a provider that cannot run a
case must say so in ``EXPECTED_REFUSALS``, anything else refused fails)."""

from __future__ import annotations

import math

import pytest
import torch

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, ProviderUnavailable, make_plan
from attnplug.core.reference import reference_attention

pytestmark = pytest.mark.gpu

# (provider, mode) -> why it refuses; everything not listed must run
EXPECTED_REFUSALS: dict[tuple[str, ForwardMode], str] = {}

CASES = [
    (ForwardMode.DECODE, 1, [(16, 700)], 40, 0, 0),
    (ForwardMode.DECODE, 1, [(5, 300), (7, 520)], 33, 0, 3),
    (ForwardMode.DECODE, 1, [(4, 200), (4, 200)], 17, 96, 1),  # nested prefixes
    (ForwardMode.TARGET_VERIFY, 6, [(6, 400)], 21, 0, 2),
    (ForwardMode.EXTEND, 9, [(3, 256), (2, 130)], 50, 0, 0),
]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("provider", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode, q_len, groups, unique, nested, loners", CASES)
def test_cascade_equals_reference_gpu(provider, page, mode, q_len, groups, unique, nested, loners):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU here)")
    cfg = AttentionConfig(32, 8, 128, page, torch.bfloat16)
    try:
        attn = PagedAttention(cfg, provider, "cuda", cascade="always")
    except ProviderUnavailable as e:
        pytest.skip(f"provider {provider!r} unavailable: {e}")
    if (provider, mode) in EXPECTED_REFUSALS:
        pytest.skip(EXPECTED_REFUSALS[(provider, mode)])
    toks = prompts(groups + [(1, 0)] * loners, unique, nested=nested, seed=page + q_len)
    batch, q, k, v, n = shared_prefix_batch(cfg, mode, toks, q_len=q_len, seed=3, device="cuda")
    plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], cfg.num_qo_heads), math.nan, device="cuda")
    attn.run(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    whole = make_plan(cfg, batch, n, device="cuda")
    ref, ref_lse = reference_attention(whole, q, k, v)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for b in range(whole.batch_size):
        lo, hi = int(whole.qo_indptr_cpu[b]), int(whole.qo_indptr_cpu[b + 1])
        assert rel(out[lo:hi], ref[lo:hi]) <= 1e-2, (b, rel(out[lo:hi], ref[lo:hi]))
    assert rel(lse, ref_lse) <= 1e-3


def test_triton_prefix_part_launches_as_a_programmatic_dependent_on_hopper(monkeypatch):
    """On sm90+ the triton provider launches its cascade graphs' prefix part as a programmatic dependent of
    the suffix part (``attnplug.core.kernels.pdl``), so the GPU runs of ``tests/core/test_cascade_graph.py``
    test that path; ``ATTNPLUG_PDL=0`` turns it off."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU here)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    from attnplug.core.providers.triton import TritonProvider

    cfg, dev = AttentionConfig(32, 8, 128, 16, torch.bfloat16), torch.device("cuda")
    assert TritonProvider(cfg, dev)._pdl()
    monkeypatch.setenv("ATTNPLUG_PDL", "0")
    assert not TritonProvider(cfg, dev)._pdl()


def _block_table(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_lens [B]`` and ``block_table [B, W]`` int32 of a host batch, as vLLM hands them over."""
    ind, last = batch.kv_indptr, batch.kv_last_page_len
    counts = ind[1:] - ind[:-1]
    P = 16
    seq = ((counts - 1) * P + last).to(torch.int32)
    table = torch.zeros(batch.batch_size, int(counts.max()), dtype=torch.int32)
    for b in range(batch.batch_size):
        table[b, : int(counts[b])] = batch.kv_indices[int(ind[b]) : int(ind[b + 1])]
    return seq, table


@pytest.mark.parametrize("provider", ["triton", "fa3"])
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_default_cascade_graph_replays_shared_unshared_shared(provider, mode):
    """Cascade graphs as the engines run them by default (``cascade="auto"``, Llama-3-8B attention, the
    H200's tile table: the prefix part on the prefill kernel, one launch that merges into the suffix state;
    fa3's on triton): one captured graph replayed on a shared batch, a batch that shares nothing and the
    shared batch again (the in-kernel merge counters re-armed on the GPU), each from the device block
    table as vLLM updates it (verify: causal-chain drafts), each equal to the float32 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU here)")
    from attnplug.core.cuda_graph import GraphState, chain_mask

    # batch sizes whose prefix tiles are the table's 256-row ones (64 rows a group; decode graphs of 16
    # requests take the paged kernel there, tested by tests/core/test_cascade_graph*.py on the GPU)
    cfg, dev, B = (
        AttentionConfig(32, 8, 128, 16, torch.bfloat16),
        torch.device("cuda"),
        (64 if mode == "decode" else 16),
    )
    q_len = 1 if mode == "decode" else 4
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.TARGET_VERIFY
    cases = []
    for groups in ([(B, 4096)], [(1, 4096)] * B):
        batch, q, k, v, n = shared_prefix_batch(
            cfg, fmode, prompts(groups, 64, seed=5), q_len=q_len, seed=5, device="cuda"
        )
        if mode == "verify":
            seq, _ = _block_table(batch)
            batch.custom_mask = torch.cat([chain_mask(q_len, int(s)).reshape(-1) for s in seq]).to(batch.custom_mask)
        cases.append((batch, q, k, v, n))
    pages = max(c[4] for c in cases)
    k_all = torch.zeros((pages, *cases[0][2].shape[1:]), dtype=cfg.dtype, device=dev)
    v_all = torch.zeros_like(k_all)
    W = max(_block_table(c[0])[1].shape[1] for c in cases)
    try:
        gs = GraphState(
            cfg,
            provider,
            max_batch=B,
            max_tokens=B * q_len,
            max_pages=pages,
            device=dev,
            mode=mode,
            num_draft_tokens=q_len,
            pad_page=pages - 1,
            max_seq_len=W * 16,
            cascade="auto",
            chain=mode == "verify",
        )
    except ProviderUnavailable as e:
        pytest.skip(f"provider {provider!r} unavailable: {e}")
    assert gs.cascade.provider.name == "triton"
    gs.prepare_capture(B)
    assert gs.cascade.plans[B].state.kernel == "prefill"
    q_buf = torch.zeros_like(cases[0][1])
    out = torch.empty_like(q_buf)
    seq_buf = torch.zeros(B, dtype=torch.int32, device=dev)
    table_buf = torch.zeros(B, W, dtype=torch.int32, device=dev)
    gs.update_from_block_table(torch.full_like(seq_buf, q_len + 1), table_buf, B)
    gs.run(B, q_buf, k_all, v_all, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gs.run(B, q_buf, k_all, v_all, out)
    for i in (0, 1, 0, 0):
        batch, q, k, v, n = cases[i]
        k_all[:n].copy_(k)
        v_all[:n].copy_(v)
        q_buf.copy_(q)
        seq, table = _block_table(batch)
        table_buf.zero_()
        table_buf[:, : table.shape[1]].copy_(table)
        seq_buf.copy_(seq)
        gs.update_from_block_table(seq_buf, table_buf, B)
        out.fill_(math.nan)
        g.replay()
        torch.cuda.synchronize()
        assert bool(gs.cascade.active) == (i == 0)
        ref, _ = reference_attention(make_plan(cfg, batch, n, device="cuda"), q, k, v)
        assert not torch.isnan(out).any()
        assert rel(out, ref) <= 1e-2, (i, rel(out, ref))
