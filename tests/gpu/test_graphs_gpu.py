"""CUDA-graph replay, for decode, tree verify and every draft step, bs 1..MAX_BS with padding, against
independent oracles: the float32 reference of the unpadded batch (replays) and dense float64 attention
over the token slots each draft row must see, listed by a python loop (draft steps); the eager run of
the same provider is checked too. Errors per request (draft: per row) and head.

Per (provider, mode): one GraphState, one graph captured per bs (all slots padded at capture), then
for several real batch sizes B <= bs: ``update`` in place, copy q into the static input, replay.
Without CUDA: skipped. On CUDA a provider that cannot load FAILS (set ``ATTNPLUG_GPU_OPTIONAL_PROVIDERS``,
comma-separated, to let it skip), and a refusal (``UnsupportedFeature``) fails unless listed in
``EXPECTED_GRAPH_REFUSALS`` (none today: every provider captures decode and verify).
"""

from __future__ import annotations

import pytest
import torch
from batches import assert_close_per_request_head, dense_rows, draft_rows, rel_err
from gpu_expectations import expect_refusal, provider_unavailable, unexpected_refusal

from attnplug.core import (
    AttentionConfig,
    BatchMetadata,
    ForwardMode,
    PagedAttention,
    ProviderUnavailable,
    UnsupportedFeature,
)
from attnplug.core.cuda_graph import GraphState
from attnplug.core.draft import MultiStepDraftPlanner, build_tree_verify_mask, token_config, token_view
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

CUDA = torch.cuda.is_available()
PROVIDERS = ["triton", "fa3", "flashinfer"]
MAX_BS, N_DRAFT, TOPK, STEPS = 4, 4, 2, 3
CFG = AttentionConfig(8, 2, 128, 16, torch.bfloat16)
NUM_PAGES = 256  # page 0 is the pad page
TOL = 1e-2
# (provider, what) -> regex of a refusal that is intended; any other refusal is a failure
EXPECTED_GRAPH_REFUSALS: dict[tuple[str, str], str] = {}


def _skip_unless(provider):
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")


def _graph_state(provider, config, what, **kw):
    """The GraphState, or ``None`` after asserting a listed refusal (the test then ends, passed)."""
    if (provider, what) in EXPECTED_GRAPH_REFUSALS:
        with expect_refusal(EXPECTED_GRAPH_REFUSALS, (provider, what)):
            GraphState(config, provider, device="cuda", pad_page=0, **kw)
        return None
    try:
        return GraphState(config, provider, device="cuda", pad_page=0, **kw)
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    except UnsupportedFeature as e:
        unexpected_refusal((provider, what), e)


def _batch(mode, B, g):
    """B requests over pages 1..NUM_PAGES-1 (random, distinct), random prefixes (mid-page ends)."""
    P, q = CFG.page_size, (1 if mode == "decode" else N_DRAFT)
    prefix = torch.randint(0, 150, (B,), generator=g)
    kv = (prefix + q).tolist()
    npg = [-(-x // P) for x in kv]
    pages = (torch.randperm(NUM_PAGES - 1, generator=g)[: sum(npg)] + 1).to(torch.int32)
    ind = torch.tensor([0] + npg).cumsum(0).to(torch.int32)
    last = torch.tensor([(x - 1) % P + 1 for x in kv], dtype=torch.int32)
    qo = (torch.arange(B + 1) * q).to(torch.int32)
    if mode == "decode":
        return BatchMetadata(ForwardMode.DECODE, qo, ind, pages, last)
    par = torch.stack(
        [torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, q)]) for _ in range(B)]
    )
    return BatchMetadata(
        ForwardMode.TARGET_VERIFY, qo, ind, pages, last, custom_mask=build_tree_verify_mask(par, prefix)
    )


def _caches(g):
    shape = CFG.kv_cache_shape(NUM_PAGES)
    return (torch.randn(shape, generator=g).to(CFG.dtype).cuda(), torch.randn(shape, generator=g).to(CFG.dtype).cuda())


def _capture_all(gs, run, q_static, out_static, tokens_per):
    graphs = {}
    for bs in range(1, MAX_BS + 1):
        gs.prepare_capture(bs)
        n = bs * tokens_per
        run(bs, q_static[:n], out_static[:n])  # warm-up: JIT / autotune outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(bs, q_static[:n], out_static[:n])
        graphs[bs] = g
    return graphs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_graph_replay_matches_reference(provider, mode):
    _skip_unless(provider)
    q_per = 1 if mode == "decode" else N_DRAFT
    gs = _graph_state(
        provider,
        CFG,
        mode,
        max_batch=MAX_BS,
        max_tokens=MAX_BS * q_per,
        max_pages=NUM_PAGES,
        mode=mode,
        num_draft_tokens=N_DRAFT,
        max_seq_len=NUM_PAGES * CFG.page_size,
    )
    if gs is None:
        return
    g = torch.Generator().manual_seed(0)
    k, v = _caches(g)
    q_static = torch.zeros(MAX_BS * q_per, CFG.num_qo_heads, CFG.head_dim, dtype=CFG.dtype, device="cuda")
    out_static = torch.zeros_like(q_static)
    graphs = _capture_all(gs, lambda bs, q, o: gs.run(bs, q, k, v, o), q_static, out_static, q_per)
    eager = PagedAttention(CFG, provider, "cuda")
    for bs in range(1, MAX_BS + 1):
        for B in sorted({bs, max(1, bs - 1), 1}):
            batch = _batch(mode, B, g)
            q = torch.randn(B * q_per, CFG.num_qo_heads, CFG.head_dim, generator=g).to(CFG.dtype).cuda()
            gs.update(batch, bs)
            q_static[: B * q_per].copy_(q)
            out_static.fill_(float("nan"))
            graphs[bs].replay()
            eager.plan(batch, num_pages=NUM_PAGES)
            ref = eager.run(q, k, v)
            oracle, _ = reference_attention(make_plan(CFG, batch, NUM_PAGES, device="cuda"), q, k, v)
            torch.cuda.synchronize()
            got = out_static[: B * q_per]
            assert not torch.isnan(got).any(), f"bs={bs} B={B}: NaN"
            assert rel_err(got, ref) <= TOL, f"bs={bs} B={B}: rel err {rel_err(got, ref):.2e} vs eager"
            assert_close_per_request_head(
                got, oracle, batch.qo_indptr, CFG.dtype, f"{provider} {mode} bs={bs} B={B} vs reference"
            )


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
def test_draft_steps_graph_replay_match_dense(provider):
    """Every draft step: a GraphState (token granularity) per step, replayed, vs dense attention over
    the listed slots (and the eager multi-step planner, itself checked against the same oracle)."""
    _skip_unless(provider)
    tc = token_config(CFG)
    P, R = CFG.page_size, MAX_BS * TOPK
    g = torch.Generator().manual_seed(1)
    k, v = _caches(g)
    kt, vt = token_view(k, CFG), token_view(v, CFG)
    states = [
        _graph_state(provider, tc, "draft", max_batch=R, max_tokens=R, max_pages=NUM_PAGES * P, max_seq_len=160 + STEPS)
        for _ in range(STEPS)
    ]
    try:
        planner = MultiStepDraftPlanner(CFG, TOPK, STEPS, MAX_BS, provider, "cuda", max_prefix_tokens=MAX_BS * 160)
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    except UnsupportedFeature as e:
        unexpected_refusal((provider, "draft planner"), e)
    if any(gs is None for gs in states):
        return
    q_static = torch.zeros(R, CFG.num_qo_heads, CFG.head_dim, dtype=CFG.dtype, device="cuda")
    out_static = torch.zeros_like(q_static)
    graphs = []
    for gs in states:  # graph "bs" counts rows: bs requests -> bs*topk rows
        runs = {}
        for bs in range(1, MAX_BS + 1):
            gs.prepare_capture(bs * TOPK)
            n = bs * TOPK
            gs.run(n, q_static[:n], kt, vt, out_static[:n])
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                gs.run(n, q_static[:n], kt, vt, out_static[:n])
            runs[bs] = gr
        graphs.append(runs)
    for bs in range(1, MAX_BS + 1):
        for B in sorted({bs, max(1, bs - 1)}):
            d = _batch("decode", B, g)  # prefix CSR: kv_len = prefix + 1 committed tokens
            used = set(d.kv_indices.tolist())
            free = torch.tensor([p for p in range(1, NUM_PAGES) if p not in used])
            slots = (
                (
                    free[torch.randperm(free.numel(), generator=g)][: -(-B * TOPK * STEPS // P)][:, None] * P
                    + torch.arange(P)
                )
                .flatten()[: B * TOPK * STEPS]
                .view(B, TOPK, STEPS)
                .to(torch.int32)
            )
            planner.plan(d.kv_indptr, d.kv_indices, d.kv_last_page_len, slots, num_pages=NUM_PAGES)
            steps = planner.step_batches(d.kv_indptr, d.kv_indices, d.kv_last_page_len, slots)
            npg = (d.kv_indptr[1:] - d.kv_indptr[:-1]).tolist()
            seq_lens = [(n - 1) * P + int(x) for n, x in zip(npg, d.kv_last_page_len.tolist())]
            rows_qo = torch.arange(B * TOPK + 1)
            for i in range(STEPS):
                q = torch.randn(B * TOPK, CFG.num_qo_heads, CFG.head_dim, generator=g).to(CFG.dtype).cuda()
                ref = planner.run(i, q, k, v, torch.full_like(q, float("nan")))
                dense = dense_rows(q, k, v, draft_rows(d.kv_indptr, d.kv_indices, seq_lens, slots, P, i), CFG)
                what = f"{provider} draft step {i} bs={bs} B={B}"
                assert_close_per_request_head(ref, dense, rows_qo, CFG.dtype, f"{what}: eager planner vs dense")
                states[i].update(steps[i], bs * TOPK)
                q_static[: B * TOPK].copy_(q)
                out_static.fill_(float("nan"))
                graphs[i][bs].replay()
                torch.cuda.synchronize()
                got = out_static[: B * TOPK]
                assert not torch.isnan(got).any(), f"{what}: NaN"
                assert rel_err(got, ref) <= TOL, f"{what}: rel err {rel_err(got, ref):.2e} vs eager"
                assert_close_per_request_head(got, dense, rows_qo, CFG.dtype, f"{what}: replay vs dense")
