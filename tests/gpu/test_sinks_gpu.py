"""Attention sinks (issue 41) on CUDA: triton, fa3 and flashinfer against the float32 reference, gpt-oss's
attention shape (64 query / 8 KV heads, d64, window 128 and full), every mode, split-KV, cascade, fp8 KV,
graph capture; sinks far above and below the rows' logits (``tests/core/test_sinks.py``'s draw).

Skipped without CUDA. A provider refusing a case fails unless the case is refused on purpose (fa3: a custom
(tree or chain) mask with a sliding window, as without sinks).
"""

from __future__ import annotations

import math

import pytest
import torch
from batches import random_case
from gpu_expectations import provider_unavailable, unexpected_refusal
from test_fp8 import quantize_fp8
from test_sinks import REL, REL_FP8, assert_matches, draw_sinks, row_err

from attnplug.core import (
    AttentionConfig,
    ForwardMode,
    PagedAttention,
    ProviderUnavailable,
    UnsupportedFeature,
)
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

CUDA = torch.cuda.is_available()
if not CUDA:
    pytest.skip("needs CUDA (no GPU here)", allow_module_level=True)
PROVIDERS = ["triton", "fa3", "flashinfer"]
E4M3 = torch.float8_e4m3fn
MODES = {  # name -> (ForwardMode, q_lens, prefix_lens, mask_kind); prefixes cross the 128-token window
    "decode": (ForwardMode.DECODE, [1] * 6, [0, 37, 300, 130, 1500, 64], "tree"),
    "extend": (ForwardMode.EXTEND, [7, 33, 1, 70], [0, 210, 50, 300], "tree"),
    "prefill": (ForwardMode.EXTEND, [300, 17, 129], [0, 0, 0], "tree"),
    "verify_tree": (ForwardMode.TARGET_VERIFY, [6, 8, 4, 8], [300, 45, 0, 640], "tree"),
    "verify_chain": (ForwardMode.TARGET_VERIFY, [4, 4, 4], [200, 9, 1000], "chain"),
}
WINDOW_TREE = r"provider 'fa3' does not support a custom \(tree\) mask together with a sliding window"


def gptoss(window: int, **kw) -> AttentionConfig:
    return AttentionConfig(64, 8, 64, 16, torch.bfloat16, window_left=window, sinks=True, **kw)


def _attn(provider, config, cascade="off"):
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    try:
        return PagedAttention(config, provider, "cuda", cascade=cascade)
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    except UnsupportedFeature as e:
        unexpected_refusal((provider, config), e)


def _run_and_check(attn, case, sinks, scales=None, lse_too=True, rel=REL, **knobs):
    scales = scales or {}
    plan = attn.plan(case.batch, num_pages=case.num_pages, **knobs)
    out = torch.full_like(case.q, math.nan)
    lse = torch.full(case.q.shape[:2], math.nan, device="cuda") if lse_too else None
    attn.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse, sinks=sinks, **scales)
    torch.cuda.synchronize()
    whole = make_plan(case.config, case.batch, case.num_pages, device="cuda")
    q = case.q
    if getattr(plan.state, "q8", None) is not None:  # fa3 on fp8: the oracle on the e4m3 query it reads
        q = plan.state.q8[: q.shape[0]].float() * scales["q_scale"]
    ref, ref_lse = reference_attention(
        whole, q, case.k_cache, case.v_cache, scales.get("k_scale"), scales.get("v_scale"), sinks
    )
    assert_matches(out, lse, ref, ref_lse, rel, attn.provider_name, lse_tol=2e-3 if rel == REL else 2e-2)
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float32], ids=["bf16sinks", "f32sinks"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", [-1, 127])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_sinks_match_reference(provider, window, mode, sink_dtype):
    """bfloat16 sinks (what the engines' gpt-oss passes; fa3 without an LSE: the build's own ``s_aux``) and
    float32 sinks (fa3: the core's join, the build takes bfloat16 only)."""
    fm, q_lens, prefix, mask_kind = MODES[mode]
    config = gptoss(window)
    case = random_case(fm, q_lens, prefix, config, "cuda", seed=len(mode) + window, mask_kind=mask_kind)
    sinks = draw_sinks(64, seed=window + 3).to(sink_dtype)
    if provider == "fa3" and window >= 0 and fm == ForwardMode.TARGET_VERIFY:  # any custom mask (chain too)
        with pytest.raises(UnsupportedFeature, match=WINDOW_TREE):
            _attn(provider, config).plan(case.batch, num_pages=case.num_pages)
        return
    attn = _attn(provider, config)
    for lse_too in (True, False):  # fa3: without an LSE its own sink argument, with one the core's join
        _run_and_check(attn, case, sinks, lse_too=lse_too)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("mode", ["decode", "extend", "verify_tree"])
def test_triton_split_kv(mode, splits):
    fm, q_lens, prefix, mask_kind = MODES[mode]
    case = random_case(fm, q_lens, prefix, gptoss(-1), "cuda", seed=splits, mask_kind=mask_kind)
    attn = _attn("triton", gptoss(-1))
    plan = _run_and_check(attn, case, draw_sinks(64, seed=splits), num_kv_splits=splits)
    assert plan.state.num_splits == splits


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["triton", "fa3"])
@pytest.mark.parametrize("mode", ["decode", "extend", "verify_chain"])
def test_fp8_kv(provider, mode):
    fm, q_lens, prefix, mask_kind = MODES[mode]
    window = -1 if provider == "fa3" and fm == ForwardMode.TARGET_VERIFY else 127  # fa3: no mask + window
    base = random_case(fm, q_lens, prefix, gptoss(window), "cuda", seed=7, mask_kind=mask_kind)
    ks, vs = torch.tensor([4 / 100], device="cuda"), torch.tensor(3 / 60, device="cuda")
    base.k_cache = quantize_fp8(base.k_cache.float() * 4, ks, E4M3)
    base.v_cache = quantize_fp8(base.v_cache.float() * 3, vs, E4M3)
    base.config = gptoss(window, kv_dtype=E4M3)
    scales = dict(k_scale=ks, v_scale=vs, q_scale=torch.tensor([0.02], device="cuda"))
    _run_and_check(_attn(provider, base.config), base, draw_sinks(64, seed=8), scales, rel=REL_FP8)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", ["decode", "verify_chain", "extend"])
def test_cascade(provider, mode):
    """Shared prefixes: the parts without the sink, joined once after their merge."""
    from attnplug.bench.shared_prefix import prompts, shared_prefix_batch

    fm, q_len = {
        "decode": (ForwardMode.DECODE, 1),
        "verify_chain": (ForwardMode.TARGET_VERIFY, 4),
        "extend": (ForwardMode.EXTEND, 5),
    }[mode]
    c = gptoss(-1)
    attn = _attn(provider, c, cascade="always")
    batch, q, k, v, n = shared_prefix_batch(
        c, fm, prompts([(3, 300), (2, 210), (1, 0)], 60, seed=q_len), q_len=q_len, seed=1, device="cuda"
    )
    sinks = draw_sinks(64, seed=q_len)
    plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, device="cuda")
    attn.run(q, k, v, out=out, lse=lse, sinks=sinks)
    ref, ref_lse = reference_attention(make_plan(c, batch, n, device="cuda"), q, k, v, sinks=sinks)
    assert_matches(out, lse, ref, ref_lse, REL, f"{provider} cascade {mode}", lse_tol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_graph_capture_reads_sinks_in_place(provider, mode):
    """``run`` with sinks captured in a CUDA graph; new q and sinks written in place apply at replay."""
    fm, q_lens, prefix, _ = MODES[mode]
    config = gptoss(127)
    attn = _attn(provider, config)
    case = random_case(fm, q_lens, prefix, config, "cuda", seed=3)
    plan = attn.plan(case.batch, num_pages=case.num_pages)
    q, sinks = case.q.clone(), draw_sinks(64, seed=1).to(torch.bfloat16)  # as the engines pass them
    out = torch.empty_like(q)
    attn.run(q, case.k_cache, case.v_cache, out=out, sinks=sinks)  # warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, case.k_cache, case.v_cache, out=out, sinks=sinks)
    q.copy_(torch.randn_like(q))
    sinks.copy_(draw_sinks(64, seed=2))  # rounded to bfloat16 in place: the reference reads the same
    g.replay()
    torch.cuda.synchronize()
    ref, _ = reference_attention(plan, q, case.k_cache, case.v_cache, sinks=sinks)
    assert row_err(out, ref) <= REL


@pytest.mark.gpu
def test_graph_state_decode_with_sinks():
    """The triton provider's GraphState (static split plans, device-refreshed metadata) with sinks."""
    from attnplug.core.cuda_graph import GraphState

    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    config = gptoss(127)
    gs = GraphState(config, "triton", max_batch=8, max_tokens=8, max_pages=400, device="cuda", mode="decode")
    bs = 6
    gs.prepare_capture(bs)
    fm, q_lens, prefix, _ = MODES["decode"]
    case = random_case(fm, q_lens, prefix, config, "cuda", seed=4)
    sinks = draw_sinks(64, seed=4)
    out = torch.empty_like(case.q)
    gs.update(case.batch, bs)
    g = torch.cuda.CUDAGraph()
    gs.run(bs, case.q, case.k_cache, case.v_cache, out, sinks=sinks)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        gs.run(bs, case.q, case.k_cache, case.v_cache, out, sinks=sinks)
    out.fill_(math.nan)
    g.replay()
    torch.cuda.synchronize()
    whole = make_plan(config, case.batch, case.num_pages, device="cuda")
    ref, _ = reference_attention(whole, case.q, case.k_cache, case.v_cache, sinks=sinks)
    assert row_err(out, ref) <= REL
