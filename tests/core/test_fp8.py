"""fp8 KV cache (issue 15) on CPU: the quantizing KV write (torch and Triton), the Triton attention
kernel dequantizing on load in every mode, the reference provider, graphs / drafts with scale
tensors, and the fa3 provider's fp8 path through a stand-in for FA3.

Oracle: float32 attention on the *dequantized* cache (``cache.float() * scale``,
``reference_attention``), on fresh random ragged batches whose K/V span the fp8 range (scales chosen
so that ``x / scale`` reaches a few hundred). Every check also asserts the scales matter (the same
run with a wrong scale fails the tolerance), so a kernel that ignored them could not pass.
"""

from __future__ import annotations

import math
import sys

import fa3_standin
import pytest
import torch
from batches import TOLERANCES, assert_close_per_request_head, random_case, rel_err

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, UnsupportedFeature, make_plan
from attnplug.core.config import kv_dtype_from_name
from attnplug.core.cuda_graph import GraphState
from attnplug.core.kv_layout import dequantize, quantize_fp8, write_kv, write_kv_fixed_shape
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
REL = 2e-2  # issue 15: relative error against the float32 reference on the dequantized cache


def fp8_case(mode, q_lens, prefix, dtype=torch.bfloat16, kv_dtype=E4M3, hq=8, hkv=2, d=64, page=16, seed=0, **kw):
    """A random case whose caches are quantized to ``kv_dtype`` with per-layer scales.

    K ~ 4 N(0,1), V ~ 3 N(0,1); scales ``4/100`` and ``3/60`` put ``x / scale`` up to ~1000, so
    some values saturate in e4m3 (clamped to 448), as with a checkpoint scale that is too small."""
    base = AttentionConfig(hq, hkv, d, page, dtype, **kw)
    c = random_case(mode, q_lens, prefix, base, DEVICE, seed=seed)
    ks = torch.tensor([4 / 100], device=DEVICE)
    vs = torch.tensor(3 / 60, device=DEVICE)  # 0-d, like vLLM's layer._v_scale
    c.k_cache = quantize_fp8(c.k_cache.float() * 4, ks, kv_dtype)
    c.v_cache = quantize_fp8(c.v_cache.float() * 3, vs, kv_dtype)
    c.config = AttentionConfig(hq, hkv, d, page, dtype, kv_dtype=kv_dtype, **kw)
    return c, ks, vs


def run_and_check(c, ks, vs, provider="triton", lse_too=True, **plan_kwargs):
    attn = PagedAttention(c.config, provider, DEVICE)
    plan = attn.plan(c.batch, num_pages=c.num_pages, **plan_kwargs)
    attn.check_inputs(c.q, c.k_cache, c.v_cache)
    out = torch.full_like(c.q, math.nan)
    lse = torch.full(c.q.shape[:2], math.nan, device=DEVICE) if lse_too else None
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, k_scale=ks, v_scale=vs)
    ref, ref_lse = reference_attention(plan, c.q, c.k_cache, c.v_cache, ks, vs)
    assert not torch.isnan(out).any(), "NaN in output"
    err = rel_err(out, ref)
    assert err <= REL, f"relative error {err:.3g} > {REL}"
    tol = TOLERANCES[c.config.dtype]  # per (request, head); V spans ~+-10 here: abs scaled to the values
    tol = dict(rel=tol["rel"], abs=tol["abs"] * max(1.0, float(ref.abs().max())))
    assert_close_per_request_head(
        out, ref, plan.qo_indptr_cpu, c.config.dtype, f"{provider} fp8 {c.config.kv_dtype}", tol
    )
    if lse_too:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert rel_err(lse[fin], ref_lse[fin]) <= 1e-4
    # the scales matter: the oracle with a wrong k or v scale is far off this output
    for wrong in ((ks * 1.5, vs), (ks, vs * 1.5)):
        bad, _ = reference_attention(plan, c.q, c.k_cache, c.v_cache, *wrong)
        assert rel_err(out, bad) > 5 * max(err, 1e-3), "output does not depend on the scales"
    return plan, out, err


# ---- config -------------------------------------------------------------------------------------------
def test_config_kv_dtype_defaults_to_model_dtype_and_refuses_other_unquantized():
    a = AttentionConfig(8, 2, 64, 16, torch.bfloat16)
    assert a.kv_dtype == torch.bfloat16 and not a.kv_quantized
    assert a == AttentionConfig(8, 2, 64, 16, torch.bfloat16, kv_dtype=torch.bfloat16)  # normalized
    f = AttentionConfig(8, 2, 64, 16, torch.float16, kv_dtype=E5M2)
    assert f.kv_quantized and f.kv_cache_shape(3) == (3, 16, 2, 64)
    with pytest.raises(ValueError, match="kv_dtype must be None, the model dtype"):
        AttentionConfig(8, 2, 64, 16, torch.bfloat16, kv_dtype=torch.float16)
    assert kv_dtype_from_name("fp8", torch.bfloat16) == E4M3 and kv_dtype_from_name("fp8_e5m2", torch.float16) == E5M2
    assert kv_dtype_from_name("auto", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'fp8_inc'"):
        kv_dtype_from_name("fp8_inc", torch.bfloat16)


# ---- quantization and the KV write --------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_quantize_saturates_rounds_and_keeps_nan(kv_dtype):
    big = MAX[kv_dtype]
    x = torch.tensor([0.0, 1.0, -1.0, 3 * big, -5 * big, big * 0.999, float("nan"), 1e-9, 2.0**-7])
    q = quantize_fp8(x, 0.5, kv_dtype).float()
    assert q[3] == big and q[4] == -big  # saturated to the largest finite value, never NaN / inf
    assert torch.isnan(q[6])
    assert q[1] == 2.0 and q[2] == -2.0 and q[0] == 0.0  # x / scale
    want = (x / 0.5).clamp(-big, big).to(kv_dtype).float()  # round to nearest even, as torch casts
    assert torch.equal(torch.nan_to_num(q, 7.0), torch.nan_to_num(want, 7.0))


def _write_case(kv_dtype, amp, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, H, D, pages, P = 200, 4, 64, 30, 16
    k = (torch.randn(T, H, D, generator=g) * amp).to(torch.bfloat16)
    v = torch.randn(T, H, D, generator=g) * amp
    slots = torch.randperm(pages * P, generator=g)[:T]
    slots[::9] = -1  # padding
    shape = (pages, P, H, D)
    return k, v, slots, shape


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("amp,scale", [(300.0, 0.5), (1.0, 0.003), (1e-3, 1.0), (4.0, 1.0)])
def test_triton_kv_write_equals_torch_quantization(kv_dtype, amp, scale):
    """One-launch Triton write == torch write (bits), saturation, subnormals and -0.0 included; padding
    slots untouched; vLLM's 5-D ``[2, pages, P, H, D]`` halves (strided) are written in place."""
    from attnplug.core.kernels.kv_write import write_kv_paged

    k, v, slots, shape = _write_case(kv_dtype, amp)
    k[:, 0, :3], v[:, 1, :3] = -0.0, -1e-30  # signed zeros (a tiny negative rounds to -0.0)
    ks, vs = torch.tensor([scale]), torch.tensor(scale * 1.7)
    kv = torch.full((2, *shape), 0.5).to(kv_dtype).to(DEVICE)  # sentinel in every untouched slot
    write_kv_paged(k.to(DEVICE), v.to(DEVICE), kv[0], kv[1], slots.to(DEVICE), ks.to(DEVICE), vs.to(DEVICE))
    rk, rv = torch.full(shape, 0.5).to(kv_dtype), torch.full(shape, 0.5).to(kv_dtype)
    write_kv(k, v, rk, rv, slots, k_scale=ks, v_scale=vs)
    for got, want in ((kv[0].cpu().float(), rk.float()), (kv[1].cpu().float(), rv.float())):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want), f"{int((got != want).sum())} values differ"
    for got, want in ((kv[0].cpu(), rk), (kv[1].cpu(), rv)):  # bit-equal, the sign of zero included
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    used = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
    used[slots[slots >= 0]] = True
    assert (kv[0].cpu().float().view(-1, *shape[2:])[~used] == 0.5).all()
    if amp * 3 / scale > MAX[kv_dtype]:
        assert (rk.float().abs() == MAX[kv_dtype]).any()  # the case reaches saturation


def test_kv_write_reads_scales_on_the_device_in_place():
    """The scale is read by the kernel, not baked in: updating the tensor in place changes the next write."""
    from attnplug.core.kernels.kv_write import write_kv_paged

    k, v, slots, shape = _write_case(E4M3, 2.0)
    kc, vc = torch.zeros(shape, dtype=E4M3, device=DEVICE), torch.zeros(shape, dtype=E4M3, device=DEVICE)
    ks, vs = torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE)
    args = (k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE), ks, vs)
    write_kv_paged(*args)
    first = kc.float().clone()
    ks.fill_(0.25)  # e.g. --calculate-kv-scales, or a checkpoint scale loaded after warm-up
    write_kv_paged(*args)
    keep = slots >= 0
    page, off = slots[keep] // shape[1], slots[keep] % shape[1]
    ratio = kc.float().cpu()[page, off] / first.cpu()[page, off]
    finite = first.cpu()[page, off].abs() > 1  # away from subnormals, x4 is exact unless saturated
    unsat = kc.float().cpu()[page, off].abs() < 448
    assert torch.allclose(ratio[finite & unsat], torch.tensor(4.0), rtol=0.07)


def test_kv_write_refuses_fp8_without_scales():
    from attnplug.core.kernels.kv_write import write_kv_paged

    k, v, slots, shape = _write_case(E4M3, 1.0)
    kc = torch.zeros(shape, dtype=E4M3, device=DEVICE)
    with pytest.raises(ValueError, match="fp8 KV write needs .* k_scale / v_scale"):
        write_kv_paged(k.to(DEVICE), v.to(DEVICE), kc, kc.clone(), slots.to(DEVICE))


@pytest.mark.parametrize("T", [1, 3, 32, 45])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_query_quantization_kernel_equals_torch(T, kv_dtype):
    """fa3's query quantization (row blocks of one head a program, a partial last block) equals the
    torch quantization bit for bit, saturation included; strided input rows, a prefix of the output."""
    from attnplug.core.kernels.kv_write import quantize_fp8_rows

    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 4, 96, generator=g) * 300
    wide = torch.zeros(T, 6, 96)
    wide[:, :4] = x
    s = torch.tensor(0.5)
    out = torch.full((T + 2, 4, 96), 7.0).to(kv_dtype).to(DEVICE)
    got = quantize_fp8_rows(wide.to(DEVICE)[:, :4], s.to(DEVICE), out[:T])
    assert got.data_ptr() == out.data_ptr() and torch.equal(out[T:].cpu().float(), torch.full((2, 4, 96), 7.0))
    assert torch.equal(got.cpu().float(), quantize_fp8(x, s, kv_dtype).float())
    # the dequantized copy (fa3's tree part reads it): fp8 value times the scale, in the given dtype
    dq = torch.full((T, 4, 96), math.nan, dtype=torch.bfloat16, device=DEVICE)
    quantize_fp8_rows(wide.to(DEVICE)[:, :4], s.to(DEVICE), torch.empty_like(out[:T]), dq)
    assert torch.equal(dq.cpu(), (quantize_fp8(x, s, kv_dtype).float() * 0.5).to(torch.bfloat16))


def test_fixed_shape_write_quantizes_like_write_kv():
    k, v, slots, shape = _write_case(E5M2, 50.0, seed=3)
    ks, vs = torch.tensor(0.1), torch.tensor([0.2])
    a = [torch.zeros(shape, dtype=E5M2) for _ in range(2)]
    b = [torch.zeros(shape, dtype=E5M2) for _ in range(2)]
    write_kv(k, v, *a, slots, k_scale=ks, v_scale=vs)
    write_kv_fixed_shape(k, v, *b, slots, scratch_page=shape[0] - 1, k_scale=ks, v_scale=vs)
    assert all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))
    assert torch.equal(dequantize(a[0], ks), a[0].float() * 0.1)


# ---- triton attention on fp8 KV --------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode(kv_dtype, page, splits):
    c, ks, vs = fp8_case(
        ForwardMode.DECODE, [1] * 5, [0, 37, 16, 129, 300], kv_dtype=kv_dtype, page=page, seed=page + splits
    )
    plan, _, _ = run_and_check(c, ks, vs, num_kv_splits=splits)
    assert plan.state.num_splits == splits


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("page", [1, 16])
def test_extend(kv_dtype, page):
    # empty prefix, prefix ending mid-page, prefix on a page boundary, a single-token extend
    c, ks, vs = fp8_case(ForwardMode.EXTEND, [23, 40, 9, 1], [0, 21, 32, 50], kv_dtype=kv_dtype, page=page, seed=7)
    run_and_check(c, ks, vs)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("page", [1, 16])
def test_tree_verify(kv_dtype, page):
    c, ks, vs = fp8_case(ForwardMode.TARGET_VERIFY, [6, 4, 9], [33, 0, 70], kv_dtype=kv_dtype, page=page, seed=11)
    run_and_check(c, ks, vs)


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,layout",
    [(torch.float16, 8, 8, 128, "HND"), (torch.float32, 4, 1, 64, "NHD"), (torch.bfloat16, 16, 2, 256, "NHD")],
)
def test_dtypes_layouts_head_dims(dtype, hq, hkv, d, layout):
    c, ks, vs = fp8_case(
        ForwardMode.EXTEND, [12, 1], [5, 40], dtype=dtype, hq=hq, hkv=hkv, d=d, kv_layout=layout, seed=d
    )
    run_and_check(c, ks, vs)


def test_soft_cap_and_window():
    c, ks, vs = fp8_case(ForwardMode.EXTEND, [17, 3], [20, 60], seed=5, logits_soft_cap=20.0, window_left=24)
    run_and_check(c, ks, vs)


def test_reference_provider_reads_fp8():
    c, ks, vs = fp8_case(ForwardMode.EXTEND, [5, 2], [9, 0], seed=2)
    run_and_check(c, ks, vs, provider="reference")


def test_default_scales_are_one():
    c, _, _ = fp8_case(ForwardMode.DECODE, [1, 1], [30, 7], seed=4)
    attn = PagedAttention(c.config, "triton", DEVICE)
    plan = attn.plan(c.batch, num_pages=c.num_pages)
    out = attn.run(c.q, c.k_cache, c.v_cache)
    ref, _ = reference_attention(plan, c.q, c.k_cache, c.v_cache)  # scale 1
    assert rel_err(out, ref) <= REL


def test_graph_state_reads_scales_in_place():
    """CUDA-graph plans (static buffers): the scale tensors are read at run time, so an in-place
    update (e.g. scales computed from the first batch) applies to the next replay."""
    c, ks, vs = fp8_case(ForwardMode.DECODE, [1, 1, 1], [40, 3, 90], seed=6)
    gs = GraphState(
        c.config, "triton", max_batch=4, max_tokens=4, max_pages=c.num_pages, device=DEVICE, max_seq_len=128
    )
    plan = gs.prepare_capture(4, c.batch)
    q = torch.cat([c.q, torch.zeros(1, *c.q.shape[1:], dtype=c.q.dtype, device=DEVICE)])
    out = torch.full_like(q, math.nan)
    ks_live, vs_live = ks.clone(), vs.clone()
    gs.run(4, q, c.k_cache, c.v_cache, out, k_scale=ks_live, v_scale=vs_live)
    ref, _ = reference_attention(make_plan(c.config, c.batch, c.num_pages, DEVICE), c.q, c.k_cache, c.v_cache, ks, vs)
    assert rel_err(out[:3], ref) <= REL
    ks_live.mul_(0.5)
    vs_live.mul_(2.0)
    gs.run(4, q, c.k_cache, c.v_cache, out, k_scale=ks_live, v_scale=vs_live)
    ref2, _ = reference_attention(
        make_plan(c.config, c.batch, c.num_pages, DEVICE), c.q, c.k_cache, c.v_cache, ks * 0.5, vs * 2.0
    )
    assert rel_err(out[:3], ref2) <= REL and rel_err(out[:3], ref) > 0.1
    assert plan is gs.plans[4]


def test_multi_step_draft_on_fp8():
    from attnplug.core.draft import MultiStepDraftPlanner

    cfg = AttentionConfig(8, 2, 64, 4, torch.bfloat16, kv_dtype=E4M3)
    planner = MultiStepDraftPlanner(cfg, topk=2, num_steps=2, max_batch=2, provider="triton", device=DEVICE)
    ref_planner = MultiStepDraftPlanner(cfg, topk=2, num_steps=2, max_batch=2, provider="reference", device=DEVICE)
    g = torch.Generator().manual_seed(0)
    num_pages = 20
    kc = quantize_fp8(torch.randn(num_pages, 4, 2, 64, generator=g) * 4, 0.04, E4M3).to(DEVICE)
    vc = quantize_fp8(torch.randn(num_pages, 4, 2, 64, generator=g) * 3, 0.05, E4M3).to(DEVICE)
    ks, vs = torch.tensor([0.04], device=DEVICE), torch.tensor([0.05], device=DEVICE)
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    indices = torch.tensor([7, 2, 9, 4, 11], dtype=torch.int32)
    last = torch.tensor([2, 4], dtype=torch.int32)
    slots = torch.arange(60, 68, dtype=torch.int64).view(2, 2, 2)  # [B, topk, steps] token slots (pages 15, 16)
    for p in (planner, ref_planner):
        p.plan(indptr, indices, last, slots.to(DEVICE), num_pages=num_pages)
    q = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    for step in range(2):
        a = planner.run(step, q, kc, vc, torch.full_like(q, math.nan), k_scale=ks, v_scale=vs)
        b = ref_planner.run(step, q, kc, vc, torch.full_like(q, math.nan), k_scale=ks, v_scale=vs)
        assert not torch.isnan(a).any() and rel_err(a, b) <= REL


# ---- capabilities and refusals --------------------------------------------------------------------
def test_provider_kv_dtypes_and_refusals():
    from attnplug.core.providers import get_provider_cls

    assert {E4M3, E5M2} <= get_provider_cls("triton").KV_DTYPES
    assert {E4M3, E5M2} <= get_provider_cls("flashinfer").KV_DTYPES
    assert E4M3 in get_provider_cls("fa3").KV_DTYPES and E5M2 not in get_provider_cls("fa3").KV_DTYPES
    fa3 = fa3_on_cpu(AttentionConfig(8, 2, 64, 16, torch.bfloat16, kv_dtype=E5M2))
    with pytest.raises(
        UnsupportedFeature, match=r"attnplug: provider 'fa3' does not support KV-cache dtype float8_e5m2"
    ):
        fa3.check_kv_dtype(fa3.config)
    fp16 = AttentionConfig(8, 2, 64, 16, torch.float16, kv_dtype=E4M3)
    with pytest.raises(
        UnsupportedFeature, match=r"provider 'fa3' does not support an fp8 KV cache with dtype torch.float16"
    ):
        fa3_on_cpu(fp16).check_config(fp16)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_flashinfer_prefill_template_on_fp8_is_fa2_on_hopper(monkeypatch, kv_dtype):
    """FlashInfer's sm90 ("fa3") prefill template cannot compile a bf16 query over fp8 KV: on an sm90
    GPU "auto" must pick fa2 for an fp8 cache (and fa3 for a bf16 one); an explicit fa3 is refused."""
    from attnplug.core.providers.flashinfer import FlashInferProvider

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flashinfer.utils", None)  # capability decides
    for kv, want in ((kv_dtype, "fa2"), (torch.bfloat16, "fa3")):
        prov = object.__new__(FlashInferProvider)  # skip check_available (needs a GPU and flashinfer)
        prov.config, prov.device = AttentionConfig(8, 2, 64, 16, torch.bfloat16, kv_dtype=kv), torch.device("cuda")
        assert prov.resolve_backend("auto") == want
    prov.config = AttentionConfig(8, 2, 64, 16, torch.bfloat16, kv_dtype=kv_dtype)
    with pytest.raises(
        UnsupportedFeature,
        match=r"attnplug: provider 'flashinfer' does not support prefill_backend='fa3' "
        r"with an fp8 KV cache",
    ):
        prov.resolve_backend("fa3")


# ---- fa3 provider, fp8 path, with a stand-in for FA3 ------------------------------------------------
def fa3_on_cpu(cfg):
    return fa3_standin.fa3_on_cpu(cfg, DEVICE)


@pytest.mark.parametrize(
    "mode,q_lens,prefix",
    [
        (ForwardMode.DECODE, [1, 1, 1], [50, 0, 17]),
        (ForwardMode.EXTEND, [9, 3], [20, 0]),
        (ForwardMode.TARGET_VERIFY, [5, 4], [33, 12]),
    ],
)
def test_fa3_fp8_path_with_stand_in(mode, q_lens, prefix):
    """q quantized to e4m3 with q_scale (saturating, like the KV write), descales expanded from the
    layer's scales, FA3's bfloat16 output; the tree part of a verify dequantizes in the Triton kernel."""
    c, ks, vs = fp8_case(mode, q_lens, prefix, seed=len(q_lens) + sum(prefix))
    plan = make_plan(c.config, c.batch, num_pages=c.num_pages, device=DEVICE)
    prov = fa3_on_cpu(c.config)
    prov.plan(plan)
    out = torch.full_like(c.q, math.nan)
    lse = torch.full(c.q.shape[:2], math.nan, device=DEVICE)
    qs = torch.tensor(0.01, device=DEVICE)  # |q| / q_scale up to ~400: e4m3's normal range, some saturation
    prov.run(plan, c.q, c.k_cache, c.v_cache, out, lse, k_scale=ks, v_scale=vs, q_scale=qs)
    q8 = plan.state.q8
    assert q8.dtype == E4M3 and torch.equal(q8.float(), quantize_fp8(c.q, qs, E4M3).float())
    # oracle: float32 attention on what FA3 is given - the dequantized cache and the dequantized query
    q_deq = q8.float() * qs
    ref, ref_lse = reference_attention(plan, q_deq, c.k_cache, c.v_cache, ks, vs)
    assert not torch.isnan(out).any()
    err = rel_err(out, ref)
    assert err <= REL, f"fa3 fp8 relative error {err:.3g}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) <= 1e-2  # tree part: bf16 q
    if mode == ForwardMode.TARGET_VERIFY:  # the Triton tree part ran on its dequantized fp8 keys
        assert plan.state.tree is not None
    # q's own quantization error (vLLM's FLASH_ATTN fp8 semantics): bounded, and the scales matter
    exact, _ = reference_attention(plan, c.q, c.k_cache, c.v_cache, ks, vs)
    assert rel_err(out, exact) <= 6e-2
    bad, _ = reference_attention(plan, q_deq, c.k_cache, c.v_cache, ks, vs * 1.5)
    assert rel_err(out, bad) > 5 * max(err, 1e-3)


@pytest.mark.parametrize("mode,q_len", [(ForwardMode.DECODE, 1), (ForwardMode.EXTEND, 5)])
def test_cascade_on_fp8(mode, q_len):
    """Shared-prefix (cascade) attention reads the fp8 cache in both parts with the layer's scales."""
    from attnplug.bench.shared_prefix import prompts, shared_prefix_batch

    base = AttentionConfig(8, 2, 32, 4, torch.bfloat16)
    toks = prompts([(3, 30), (2, 21)] + [(1, 0)], 6, seed=q_len)
    batch, q, k, v, n = shared_prefix_batch(base, mode, toks, q_len=q_len, seed=1, device=DEVICE)
    ks, vs = torch.tensor([0.05], device=DEVICE), torch.tensor([0.04], device=DEVICE)
    k8, v8 = quantize_fp8(k.float() * 4, ks, E4M3), quantize_fp8(v.float() * 3, vs, E4M3)
    cfg = AttentionConfig(8, 2, 32, 4, torch.bfloat16, kv_dtype=E4M3)
    attn = PagedAttention(cfg, "triton", DEVICE, cascade="always")
    plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None and plan.cascade.shared_tokens > 0
    out = attn.run(q, k8, v8, out=torch.full_like(q, math.nan), k_scale=ks, v_scale=vs)
    ref, _ = reference_attention(make_plan(cfg, batch, n, device=DEVICE), q, k8, v8, ks, vs)
    err = rel_err(out, ref)
    assert not torch.isnan(out).any() and err <= REL, err
    bad, _ = reference_attention(make_plan(cfg, batch, n, device=DEVICE), q, k8, v8, ks, vs * 1.5)
    assert rel_err(out, bad) > 5 * err
