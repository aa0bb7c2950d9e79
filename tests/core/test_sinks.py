"""Attention sinks (issue 41) against the float32 reference: every mode, ragged batches, random page
tables, sinks far above and below the rows' logits; the sink joins each row's softmax exactly once
(split-KV partials, cascade parts, graph replays, draft steps).

CPU: triton (Triton interpreter), the reference provider and fa3 through its CPU stand-in.
"""

from __future__ import annotations

import inspect
import math

import fa3_standin
import pytest
import torch
from batches import random_case
from test_fp8 import fp8_case

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, UnsupportedFeature
from attnplug.core.cuda_graph import GraphState
from attnplug.core.kernels.merge import apply_sinks
from attnplug.core.plan import make_plan
from attnplug.core.providers import get_provider_cls
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
REL, REL_FP8 = 1e-2, 3e-2
SHAPES = {"gptoss": (64, 8, 64), "small": (8, 2, 32)}  # (Hq, Hkv, D)


def draw_sinks(hq: int, seed: int) -> torch.Tensor:
    """``[hq]`` float32 sink logits: a third far above every logit (+50 beyond), a third far below
    (-50 beyond), the rest among the logits (logits of these cases lie within about +-6)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(hq, generator=g) * 3
    kind = torch.randperm(hq, generator=g) % 3
    s = torch.where(kind == 0, 56.0 + s.abs(), torch.where(kind == 1, -56.0 - s.abs(), s))
    return s.to(DEVICE)


def row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error with every row (token, head) of ``[T, H, D]`` scaled to unit reference norm, so a row
    scaled by e^-50 by its sink counts as much as any other: the RMS of the rows' relative L2 errors, or
    a fifth of the worst row's when larger (one wrong row fails). NaN gives NaN (never a pass)."""
    o, r = out.float().cpu(), ref.float().cpu()
    if torch.isnan(o).any():
        return math.nan
    e = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
    return max(float(e.square().mean().sqrt()), float(e.max()) / 5)


def assert_matches(out, lse, ref, ref_lse, rel, what="", lse_tol=1e-4):
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    err = row_err(out, ref)
    assert err <= rel, f"{what}: row relative error {err:.3g} > {rel}"
    if lse is not None:
        assert torch.isfinite(lse).all(), f"{what}: LSE not finite (the sink is finite)"
        lerr = float(((lse.float() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max())
        assert lerr <= lse_tol, f"{what}: LSE error {lerr:.3g}"


def make_case(mode, shape, window, seed, kv="bf16", mask_kind="tree"):
    """A ragged batch of ``mode`` (decode / extend / prefill / verify) with prefixes that cross the window."""
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    B = 4
    prefix = torch.randint(0, 200, (B,), generator=g).tolist()
    prefix[0] = 0
    if mode == "decode":
        q_lens, fm = [1] * B, ForwardMode.DECODE
        prefix[0] = 1  # a decode token sees at least itself
    elif mode == "extend":
        q_lens, fm = torch.randint(1, 12, (B,), generator=g).tolist(), ForwardMode.EXTEND
    elif mode == "prefill":
        q_lens, fm, prefix = torch.randint(1, 40, (B,), generator=g).tolist(), ForwardMode.EXTEND, [0] * B
    else:
        q_lens, fm = [4] * B, ForwardMode.TARGET_VERIFY
    kw = dict(window_left=window)
    if kv == "fp8":
        c, ks, vs = fp8_case(fm, q_lens, prefix, hq=hq, hkv=hkv, d=d, seed=seed, sinks=True, **kw)
        return c, dict(k_scale=ks, v_scale=vs)
    cfg = AttentionConfig(hq, hkv, d, 16, torch.bfloat16, sinks=True, **kw)
    c = random_case(fm, q_lens, prefix, cfg, DEVICE, seed=seed, mask_kind=mask_kind)
    return c, {}


def run_case(c, scales, provider="triton", cascade="off", lse_too=True, sink_dtype=torch.float32, **knobs):
    sinks = draw_sinks(c.config.num_qo_heads, seed=c.q.shape[0]).to(sink_dtype)
    attn = PagedAttention(c.config, provider, DEVICE, cascade=cascade)
    plan = attn.plan(c.batch, num_pages=c.num_pages, **knobs)
    out = torch.full_like(c.q, math.nan)
    lse = torch.full(c.q.shape[:2], math.nan, device=DEVICE) if lse_too else None
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, sinks=sinks, **scales)
    whole = make_plan(c.config, c.batch, c.num_pages, device=DEVICE)
    ref, ref_lse = reference_attention(
        whole, c.q, c.k_cache, c.v_cache, scales.get("k_scale"), scales.get("v_scale"), sinks
    )
    return plan, out, lse, ref, ref_lse, sinks


MODES = ["decode", "extend", "prefill", "verify"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window", [-1, 127])
def test_triton_modes(mode, shape, window):
    c, scales = make_case(mode, SHAPES[shape], window, seed=hash((mode, shape, window)) % 1000)
    _, out, lse, ref, ref_lse, _ = run_case(c, scales)
    assert_matches(out, lse, ref, ref_lse, REL, f"{mode} {shape} window {window}")


@pytest.mark.parametrize("mode", ["decode", "extend", "verify"])
@pytest.mark.parametrize("splits", [2, 3])
def test_triton_split_kv(mode, splits):
    """Split partials carry no sink; the merge (separate or fused into the decode kernel) adds it once."""
    c, scales = make_case(mode, SHAPES["small"], -1, seed=11 + splits)
    plan, out, lse, ref, ref_lse, _ = run_case(c, scales, num_kv_splits=splits)
    assert plan.state.num_splits == splits
    assert_matches(out, lse, ref, ref_lse, REL, f"{mode} split {splits}")
    _, out2, _, ref2, _, _ = run_case(c, scales, lse_too=False, num_kv_splits=splits)  # no LSE asked
    assert row_err(out2, ref2) <= REL


def run_forced(c, scales, entries, **knobs):
    """:func:`run_case` with ``entries`` in the tile table and the H200's SM count (the GPU's choice)."""
    from test_fast_kernels import H200_SMS, table

    sinks = draw_sinks(c.config.num_qo_heads, seed=c.q.shape[0] + 1)
    with table(entries):
        attn = PagedAttention(c.config, "triton", DEVICE)
        attn.provider._sms = H200_SMS
        plan = attn.plan(c.batch, num_pages=c.num_pages, **knobs)
    out, lse = torch.full_like(c.q, math.nan), torch.full(c.q.shape[:2], math.nan, device=DEVICE)
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, sinks=sinks, **scales)
    ref, ref_lse = reference_attention(
        plan, c.q, c.k_cache, c.v_cache, scales.get("k_scale"), scales.get("v_scale"), sinks
    )
    return plan, out, lse, ref, ref_lse


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [-1, 127])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_triton_decode_kernel_fused_merge(fused, window, kv):
    """The split-KV decode kernel: unsplit (the sink in the program's state) and split (the sink in
    the fused merge, or in merge_splits after it)."""
    from test_fast_kernels import decode_entries

    c, scales = make_case("decode", (16, 4, 64), window, seed=5, kv=kv)
    for splits in (1, 4):
        entries = decode_entries(c.config, fused)
        plan, out, lse, ref, ref_lse = run_forced(c, scales, entries, num_kv_splits=splits)
        assert plan.state.kernel == "decode" and plan.state.num_splits == splits
        assert (plan.state.counters is not None) == (fused and splits > 1)
        rel = REL_FP8 if kv == "fp8" else REL
        assert_matches(out, lse, ref, ref_lse, rel, f"decode kernel splits {splits}")


@pytest.mark.parametrize("causal", [True, False])
def test_triton_prefill_kernel(causal):
    """The prefill kernel: causal (the sink in the state), and non-causal split (the merge adds it)."""
    from test_fast_kernels import prefill_entry

    c, scales = make_case("prefill" if causal else "extend", (8, 2, 64), -1, seed=6)
    c.batch.causal = causal
    entries = prefill_entry(c.config)
    entries.update({k.replace("/prefill", "/noncausal"): e for k, e in entries.items()})
    for splits in (1,) if causal else (1, 3):
        plan, out, lse, ref, ref_lse = run_forced(c, scales, entries, num_kv_splits=splits)
        assert plan.state.kernel == "prefill" and plan.state.num_splits == splits
        assert_matches(out, lse, ref, ref_lse, REL, f"prefill kernel causal={causal} splits {splits}")


@pytest.mark.parametrize("mode", ["decode", "extend", "verify"])
@pytest.mark.parametrize("window", [-1, 127])
def test_triton_fp8(mode, window):
    c, scales = make_case(mode, SHAPES["small"], window, seed=21, kv="fp8")
    _, out, lse, ref, ref_lse, _ = run_case(c, scales)
    assert_matches(out, lse, ref, ref_lse, REL_FP8, f"fp8 {mode}")
    _, out, lse, ref, ref_lse, _ = run_case(c, scales, num_kv_splits=3)
    assert_matches(out, lse, ref, ref_lse, REL_FP8, f"fp8 {mode} split")


def test_triton_soft_cap_and_chain_verify():
    cfg = AttentionConfig(8, 2, 32, 16, torch.bfloat16, logits_soft_cap=5.0, window_left=127, sinks=True)
    c = random_case(ForwardMode.TARGET_VERIFY, [5, 3, 4], [30, 0, 150], cfg, DEVICE, seed=3, mask_kind="chain")
    _, out, lse, ref, ref_lse, _ = run_case(c, {})
    assert_matches(out, lse, ref, ref_lse, REL, "soft cap chain verify")


@pytest.mark.parametrize("provider", ["triton", "reference", "fa3"])
@pytest.mark.parametrize("mode", ["decode", "verify", "extend"])
def test_cascade(provider, mode, monkeypatch):
    """Prefix part + suffix part + merge count the sink once (fa3: its CPU stand-in)."""
    from attnplug.bench.shared_prefix import prompts, shared_prefix_batch

    if provider == "fa3":
        fa3_standin.patch_fa3(monkeypatch)
    c = AttentionConfig(8, 2, 64, 4, torch.bfloat16, sinks=True)
    fm = dict(decode=ForwardMode.DECODE, verify=ForwardMode.TARGET_VERIFY, extend=ForwardMode.EXTEND)[mode]
    q_len = {"decode": 1, "verify": 4, "extend": 5}[mode]
    toks = prompts([(3, 30), (2, 21), (1, 0)], 6, seed=q_len)
    batch, q, k, v, n = shared_prefix_batch(c, fm, toks, q_len=q_len, seed=1, device=DEVICE)
    sinks = draw_sinks(8, seed=q_len)
    whole = make_plan(c, batch, n, device=DEVICE)
    ref, ref_lse = reference_attention(whole, q, k, v, sinks=sinks)
    for cascade in ("always", "off"):
        attn = PagedAttention(c, provider, DEVICE, cascade=cascade)
        plan = attn.plan(batch, num_pages=n)
        assert (plan.cascade is not None) == (cascade == "always")
        for lse in (torch.full(q.shape[:2], math.nan, device=DEVICE), None):
            out = torch.full_like(q, math.nan)
            attn.run(q, k, v, out=out, lse=lse, sinks=sinks)
            assert_matches(out, lse, ref, ref_lse, REL, f"cascade {cascade} {mode}")


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_graph_state(mode, kv):
    """GraphState's static plans (split count fixed at capture) with sinks, refreshed in place."""
    fp8 = kv == "fp8"
    q_per, fm = (1, ForwardMode.DECODE) if mode == "decode" else (4, ForwardMode.TARGET_VERIFY)
    sinks = draw_sinks(8, seed=9)
    gs, bs = None, 3
    for B, seed in ((3, 1), (2, 2)):
        prefix = [40 + 70 * i for i in range(B)]
        if fp8:
            c, ks, vs = fp8_case(fm, [q_per] * B, prefix, hq=8, hkv=2, d=32, seed=seed, sinks=True, window_left=127)
            scales = dict(k_scale=ks, v_scale=vs)
        else:
            cfg = AttentionConfig(8, 2, 32, 16, torch.bfloat16, sinks=True, window_left=127)
            c, scales = random_case(fm, [q_per] * B, prefix, cfg, DEVICE, seed=seed), {}
        if gs is None:
            gs = GraphState(
                c.config,
                "triton",
                max_batch=4,
                max_tokens=16,
                max_pages=300,
                device=DEVICE,
                mode=mode,
                num_draft_tokens=4,
                pad_page=0,  # a page of every case's cache: the second case's cache is smaller than the first's
                num_kv_splits=2,
            )
            gs.prepare_capture(bs)
        gs.update(c.batch, bs)
        T = B * q_per
        qpad = torch.cat([c.q, torch.randn(bs * q_per - T, *c.q.shape[1:]).to(c.q)])
        out = torch.full_like(qpad, math.nan)
        gs.run(bs, qpad, c.k_cache, c.v_cache, out, sinks=sinks, **scales)
        ref, _ = reference_attention(
            make_plan(c.config, c.batch, c.num_pages, device=DEVICE),
            c.q,
            c.k_cache,
            c.v_cache,
            scales.get("k_scale"),
            scales.get("v_scale"),
            sinks,
        )
        assert row_err(out[:T], ref) <= (REL_FP8 if fp8 else REL), f"graph {mode} {kv} B={B}"


@pytest.mark.parametrize("splits", [1, 2])
def test_multi_step_draft(splits):
    """Every draft step with sinks equals the reference provider over the same step plans."""
    from test_draft import draft_case

    from attnplug.core.draft import MultiStepDraftPlanner

    seq_lens, topk, steps, page = [37, 0, 160], 2, 2, 16
    ind, idx, last, draft, num_pages = draft_case(seq_lens, page, topk, steps, seed=4)
    c = AttentionConfig(8, 2, 32, page, torch.bfloat16, sinks=True, window_left=127)
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(c.dtype).to(DEVICE)
    v_cache = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(c.dtype).to(DEVICE)
    pl = MultiStepDraftPlanner(c, topk, steps, max_batch=3, provider="triton", device=DEVICE, num_kv_splits=splits)
    ref_pl = MultiStepDraftPlanner(
        c, topk, steps, max_batch=3, provider="reference", device=DEVICE, max_prefix_tokens=400
    )
    pl.plan(ind, idx, last, draft, num_pages=num_pages)
    ref_pl.plan(ind, idx, last, draft, num_pages=num_pages)
    sinks = draw_sinks(8, seed=2)
    R = len(seq_lens) * topk
    for i in range(steps):
        q = torch.randn(R, c.num_qo_heads, c.head_dim, generator=g).to(c.dtype).to(DEVICE)
        out, ref = torch.full_like(q, math.nan), torch.full_like(q, math.nan)
        lse, ref_lse = (torch.full(q.shape[:2], math.nan, device=DEVICE) for _ in range(2))
        pl.run(i, q, k_cache, v_cache, out, lse, sinks=sinks)
        ref_pl.run(i, q, k_cache, v_cache, ref, ref_lse, sinks=sinks)
        assert_matches(out, lse, ref, ref_lse, REL, f"draft step {i}")


@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_fa3_standin(monkeypatch, kv, sink_dtype):
    """fa3 (CPU stand-in of vLLM's build, whose ``s_aux`` takes bfloat16 sinks): decode, extend and tree
    verify, full attention; without an LSE the build's sink argument (no tree part, bfloat16 sinks), with
    one (or float32 sinks, which the build would refuse) the core's join."""
    from attnplug.core.providers import fa3

    fa3_standin.patch_fa3(monkeypatch)
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("s_aux") is not None)
        return fa3_standin.fake_fa3_varlen(*args, **kw)

    spy.__signature__ = inspect.signature(fa3_standin.fake_fa3_varlen)
    monkeypatch.setattr(fa3, "load_fa3", lambda: fa3.FA3Lib("fake", spy, varlen_style=True))
    for mode in ("decode", "extend", "verify"):
        c, scales = make_case(mode, (8, 2, 64), -1, seed=31, kv=kv)
        if kv == "fp8":
            scales["q_scale"] = torch.tensor([0.02], device=DEVICE)
        rel = REL_FP8 if kv == "fp8" else REL
        for lse_too in (True, False):
            calls.clear()
            plan, out, lse, ref, ref_lse, sinks = run_case(
                c, scales, provider="fa3", lse_too=lse_too, sink_dtype=sink_dtype
            )
            own = not lse_too and mode != "verify" and sink_dtype == torch.bfloat16
            assert calls and all(calls) == own, (mode, lse_too, calls)
            if kv == "fp8":  # FA3 reads q quantized to e4m3: the oracle on the same (dequantized) query
                q_deq = plan.state.q8.float() * scales["q_scale"]
                ref, ref_lse = reference_attention(
                    plan, q_deq, c.k_cache, c.v_cache, scales["k_scale"], scales["v_scale"], sinks
                )
            lse_tol = 1e-2 if kv == "fp8" else 1e-4
            assert_matches(out, lse, ref, ref_lse, rel, f"fa3 {mode} lse={lse_too}", lse_tol)


def test_apply_sinks_kernel():
    """The exact join: out * sigmoid(lse - sink), logaddexp(lse, sink); empty rows become (0, sink)."""
    T, H, D = 5, 6, 24
    g = torch.Generator().manual_seed(0)
    out = torch.randn(T, H, D, generator=g).to(DEVICE)
    lse = (torch.randn(T, H, generator=g) * 4).to(DEVICE)
    lse[0, :2] = -math.inf
    out[0, :2] = math.nan  # an empty row's output is never read
    sinks = draw_sinks(H, seed=1)
    want_o = torch.where(torch.isinf(lse)[..., None], 0.0, out * torch.sigmoid(lse - sinks)[..., None])
    want_l = torch.logaddexp(lse, sinks)
    lse_t = lse.t().contiguous().t()  # strided LSE (fa3's view)
    apply_sinks(out, lse_t, sinks)
    assert torch.allclose(out, want_o, rtol=1e-5, atol=1e-30) and torch.allclose(lse_t, want_l, rtol=1e-6)


def test_validation_and_capability():
    c = AttentionConfig(8, 2, 32, 16, torch.bfloat16, sinks=True)
    case = random_case(ForwardMode.DECODE, [1, 1], [5, 9], c, DEVICE)
    attn = PagedAttention(c, "triton", DEVICE)
    attn.plan(case.batch, num_pages=case.num_pages)
    with pytest.raises(ValueError, match="attnplug: this layer has attention sinks"):
        attn.run(case.q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match=r"attnplug: sinks must be a \[8\]"):
        attn.run(case.q, case.k_cache, case.v_cache, sinks=torch.zeros(4, device=DEVICE))
    plain = AttentionConfig(8, 2, 32, 16, torch.bfloat16)
    attn = PagedAttention(plain, "triton", DEVICE)
    attn.plan(case.batch, num_pages=case.num_pages)
    with pytest.raises(ValueError, match="attnplug: sinks given for a layer configured without"):
        attn.run(case.q, case.k_cache, case.v_cache, sinks=torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="sinks must be a bool"):
        AttentionConfig(8, 2, 32, 16, sinks=1)
    assert c != plain  # part of the layer key
    for name in ("triton", "fa3", "flashinfer", "reference"):
        assert get_provider_cls(name).supports_sinks()
    assert get_provider_cls("triton").NATIVE_SINKS and get_provider_cls("reference").NATIVE_SINKS

    class NoSinks(get_provider_cls("reference")):
        @classmethod
        def supports_sinks(cls):
            return False

    with pytest.raises(UnsupportedFeature, match="provider 'reference' does not support attention sinks"):
        NoSinks(c, torch.device(DEVICE))
    NoSinks(plain, torch.device(DEVICE))  # no sinks asked: no refusal


@pytest.mark.parametrize("provider", ["triton", "fa3"])
@pytest.mark.parametrize("lse_too", [True, False])
def test_cascade_graph(provider, lse_too, monkeypatch):
    """GraphState's cascade (the common prefix of the batch read once, the prefix part merged into the
    suffix part inside the graph): the sink joins once, after the merge (fa3: its CPU stand-in)."""
    from attnplug.bench.shared_prefix import prompts, shared_prefix_batch

    if provider == "fa3":
        fa3_standin.patch_fa3(monkeypatch)
    c = AttentionConfig(8, 2, 32 if provider == "triton" else 64, 4, torch.bfloat16, sinks=True)
    toks = prompts([(4, 40)], 6, seed=2)
    batch, q, k, v, n = shared_prefix_batch(c, ForwardMode.DECODE, toks, seed=2, device=DEVICE)
    k[0], v[0] = 0.5, 0.25  # the pad page: finite
    gs = GraphState(
        c,
        provider,
        max_batch=6,
        max_tokens=6,
        max_pages=400,
        device=DEVICE,
        pad_page=0,
        max_seq_len=96,
        cascade="always",
    )
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    gs.update(batch, bs)
    assert int(gs.cascade.shared[0]) > 0
    sinks = draw_sinks(8, seed=5)
    B = batch.batch_size
    qpad = torch.cat([q, torch.randn(bs - B, *q.shape[1:]).to(q)])
    out = torch.full_like(qpad, math.nan)
    lse = torch.full((bs, 8), math.nan, device=DEVICE) if lse_too else None
    gs.run(bs, qpad, k, v, out, lse, sinks=sinks)
    ref, ref_lse = reference_attention(make_plan(c, batch, n, device=DEVICE), q, k, v, sinks=sinks)
    assert_matches(out[:B], None if lse is None else lse[:B], ref, ref_lse, REL, f"{provider} cascade graph")
    assert torch.isfinite(out[B:]).all()
