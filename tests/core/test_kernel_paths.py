"""Every path of the attention kernel (``core/kernels/attention.py``) and the merge kernels
(``core/kernels/merge.py``), on CPU through the Triton interpreter, against the float32 reference.

What each test makes the kernel do (and asserts that it did, from the launch the plan chose):
* phase 1 (mask-free whole blocks) with a custom mask: committed prefixes longer than ``BLOCK_N``
  (the default 128 of verify plans) and a small ``block_n`` forced through the plan knobs, with tree,
  random and "hole" masks (an all-visible column after a partly hidden one: not mask-free);
* real split-KV: keys land in several splits (the split LSE workspace, poisoned with NaN before the
  run, shows which splits got keys), for decode, verify and extend; the merge of the splits;
* several tiles per request (``block_m`` forced), causal / window / soft-cap / non-causal;
* page sizes 1, 16 and 256; NHD and HND; K and V caches with different strides;
* float32 with a tight tolerance next to bf16 / fp16.

Errors are measured per request and per head (max abs and relative to the block's largest reference
value, ``batches.assert_close_per_request_head``), outputs are poisoned with NaN before every run, and
the reference itself is checked against a float64 dense oracle built from the case's own lists (no
core code), so a planner bug cannot hide in the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from batches import (
    assert_close_per_request_head,
    dense_reference,
    random_case,
    triton_launch,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention
from attnplug.core.kernels.merge import merge_splits, merge_state
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LSE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-4, torch.float16: 2e-4}  # max abs, natural log
V, E, X, M = ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE


def cfg(hq=8, hkv=2, d=32, page=16, dtype=torch.bfloat16, **kw):
    return AttentionConfig(hq, hkv, d, page, dtype, **kw)


def run_checked(case, lse_too: bool = True, **knobs):
    """Plan + run triton on ``case`` (outputs, LSE and split workspace poisoned with NaN first), check
    it per (request, head) against the float32 reference, and the reference against the dense float64
    oracle. Returns ``(plan, launch, out)``; ``launch['partial_lse']`` holds what the run wrote."""
    attn = PagedAttention(case.config, "triton", DEVICE)
    plan = attn.plan(case.batch, num_pages=case.num_pages, **knobs)
    attn.check_inputs(case.q, case.k_cache, case.v_cache)
    launch = triton_launch(plan)
    for name in ("num_kv_splits", "block_n", "block_m"):  # a knob that did not reach the launch is a test bug
        if name in knobs:
            assert launch[name.replace("num_kv_", "num_")] == knobs[name], (name, launch)
    if launch["partial_lse"] is not None:
        launch["partial_lse"].fill_(math.nan)
        launch["partial"].fill_(math.nan)
    out = torch.full_like(case.q, math.nan)
    lse = torch.full((case.q.shape[0], case.config.num_qo_heads), math.nan, device=DEVICE) if lse_too else None
    attn.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse)
    ref, ref_lse = reference_attention(plan, case.q, case.k_cache, case.v_cache)
    dense, dense_lse = dense_reference(case)
    qo = case.batch.qo_indptr
    # float32 vs float64: the summation order of torch's CPU matmuls varies between runs, and 300-key
    # rows have seen 1.04e-5 (abs); a wrong reference is off by orders of magnitude more
    assert_close_per_request_head(
        ref, dense, qo, torch.float32, "reference vs dense float64 oracle", tol=dict(rel=1e-4, abs=5e-5)
    )
    dt = case.config.dtype
    assert_close_per_request_head(out, ref, qo, dt, f"triton {dt} vs reference ({knobs or 'default launch'})")
    if lse_too:
        fin = torch.isfinite(ref_lse.cpu())
        assert torch.equal(fin, torch.isfinite(dense_lse)), "reference LSE finiteness vs dense"
        got = lse.cpu()
        assert not torch.isnan(got).any(), "LSE row left unwritten (NaN)"
        assert torch.equal(torch.isfinite(got), fin), "LSE finiteness differs from the reference"
        err = float((got[fin] - ref_lse.cpu()[fin]).abs().max()) if fin.any() else 0.0
        assert err <= LSE_TOL[dt], f"LSE max abs error {err:.3g} > {LSE_TOL[dt]}"
    return plan, launch, out


def keys_per_split(plan, launch) -> list[int]:
    """Per request: the most splits any of its rows got keys in (finite split LSE for every head),
    read from the split workspace the run wrote (poisoned before: NaN = never written). The fused-merge
    decode kernel's splits past a request's keys return at once (:mod:`attnplug.core.kernels.decode`):
    there, and only there, trailing splits stay unwritten."""
    pl = launch["partial_lse"].cpu()
    nan = torch.isnan(pl)
    if launch["fused_merge"]:
        assert torch.equal(nan, nan.int().cummax(dim=2).values.bool()), "an unwritten split before a written one"
        pl = pl.nan_to_num(nan=-math.inf)
    else:
        assert not nan.any(), "a split partial was never written"
    nonempty = torch.isfinite(pl).all(dim=1).sum(dim=1)  # [T]: splits with keys, every head
    qo = plan.qo_indptr_cpu.tolist()
    return [int(nonempty[qo[b] : qo[b + 1]].max()) if qo[b + 1] > qo[b] else 0 for b in range(len(qo) - 1)]


def hole_mask_case(page, dtype, seed=0):
    """Verify batch whose masks have an all-visible column AFTER a partly hidden one: only the
    leading all-visible columns are mask-free (request 0: 40 visible, col 40 hidden for one row,
    cols 41..139 visible again, then a tree)."""
    c = random_case(V, [5, 3], [140, 70], cfg(page=page, dtype=dtype), DEVICE, seed=seed)
    m = c.batch.custom_mask.clone()
    kv0 = c.kv_lens[0]
    m[: 5 * kv0].view(5, kv0)[2, 40] = False
    kv1 = c.kv_lens[1]
    m[5 * kv0 :].view(3, kv1)[0, 17] = False
    c.batch.custom_mask = m
    return c


# ---- phase 1 with a custom mask: the mask-free prefix blocks ------------------------------------------
@pytest.mark.parametrize("mask_kind", ["random", "tree"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verify_prefix_longer_than_default_block(dtype, mask_kind):
    """Default verify launch (BLOCK_N 128), prefixes of 130..300 keys: with tree masks whole blocks lie
    below mask_free (phase 1 runs); random masks hide prefix keys in those same blocks (it must not)."""
    c = random_case(V, [8, 5, 16, 4], [300, 0, 130, 47], cfg(dtype=dtype), DEVICE, seed=1, mask_kind=mask_kind)
    plan, launch, _ = run_checked(c)
    assert launch["block_n"] == 128 and launch["num_splits"] == 1
    free = plan.mask_free_cpu.tolist()
    if mask_kind == "tree":
        assert sum(f // launch["block_n"] for f in free) >= 3, f"mask_free {free}: phase 1 would not run"


@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("mask_kind", ["tree", "random"])
def test_verify_small_block_n_forced(page, mask_kind):
    """``block_n=16``: many mask-free blocks, then the masked ones; random masks hide prefix keys."""
    c = random_case(V, [6, 11, 3], [90, 33, 0], cfg(page=page), DEVICE, seed=page, mask_kind=mask_kind)
    plan, launch, _ = run_checked(c, block_n=16)
    if mask_kind == "tree":
        assert min(plan.mask_free_cpu.tolist()[:2]) >= 2 * 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mask_free_counts_only_leading_visible_columns(dtype):
    c = hole_mask_case(16, dtype)
    plan, _, _ = run_checked(c, block_n=16)
    assert plan.mask_free_cpu.tolist() == [40, 17]


# ---- split-KV: keys in several splits, merged ----------------------------------------------------------
@pytest.mark.parametrize("mode", [M, V, E])
@pytest.mark.parametrize("splits", [2, 3])
def test_keys_land_in_several_splits(mode, splits):
    q_lens = [1] * 4 if mode == M else [5, 1, 9, 3]
    prefix = [99, 36, 15, 0]
    c = random_case(mode, q_lens, prefix, cfg(), DEVICE, seed=splits, mask_kind="random")
    plan, launch, _ = run_checked(c, num_kv_splits=splits, block_n=16)
    used = keys_per_split(plan, launch)
    for b, kl in enumerate(c.kv_lens):
        if kl >= 2 * 16:
            assert used[b] >= 2, f"request {b} (kv_len {kl}): keys in {used[b]} split(s) only"
    assert max(used) == splits, f"no request used all {splits} splits: {used}"


@pytest.mark.parametrize("page", [1, 16, 256])
def test_split_decode_float32_tight(page):
    c = random_case(M, [1] * 5, [0, 37, 16, 127, 255], cfg(page=page, dtype=torch.float32), DEVICE, seed=page)
    plan, launch, _ = run_checked(c, num_kv_splits=4, block_n=32)
    assert keys_per_split(plan, launch)[3:] == [4, 4]


def test_split_with_window_and_softcap():
    c = random_case(M, [1] * 3, [200, 64, 9], cfg(logits_soft_cap=3.0, window_left=70), DEVICE, seed=4)
    plan, launch, _ = run_checked(c, num_kv_splits=3, block_n=16)
    assert max(keys_per_split(plan, launch)) == 3


# ---- several tiles per request ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["causal", "window", "softcap", "non_causal", "verify"])
def test_several_tiles_per_request(variant, dtype):
    kw = {"window": dict(window_left=21), "softcap": dict(logits_soft_cap=4.0)}.get(variant, {})
    mode = V if variant == "verify" else X
    c = random_case(mode, [23, 1, 17, 40], [50, 70, 0, 33], cfg(dtype=dtype, **kw), DEVICE, seed=9, mask_kind="random")
    if variant == "non_causal":
        c.batch.causal = False
    plan, launch, _ = run_checked(c, block_m=16, block_n=16)
    assert launch["block_q"] == 4 and launch["num_tiles"] == 6 + 1 + 5 + 10


# ---- page sizes, layouts, dtypes --------------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 256])
@pytest.mark.parametrize("mode", [M, E, V, X])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_page_sizes_1_and_256(page, mode, dtype):
    q_lens = [1, 1, 1] if mode == M else [7, 1, 12]
    c = random_case(mode, q_lens, [300, 0, 61], cfg(page=page, dtype=dtype), DEVICE, seed=page + 1)
    run_checked(c)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_layouts_and_dtypes(layout, dtype):
    c = random_case(X, [1, 9, 30], [40, 70, 5], cfg(hq=8, hkv=4, d=64, dtype=dtype, kv_layout=layout), DEVICE, seed=3)
    run_checked(c, num_kv_splits=2, block_n=16)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_k_and_v_caches_with_different_strides(layout):
    """K contiguous, V a view of a differently ordered buffer: the kernel must use each one's strides."""
    c = random_case(X, [1, 9, 4], [40, 20, 70], cfg(kv_layout=layout, page=16), DEVICE, seed=5)
    v = c.v_cache
    perm = (1, 0, 2, 3) if layout == "NHD" else (2, 0, 1, 3)  # token-major storage
    inv = [perm.index(i) for i in range(4)]
    c.v_cache = v.permute(*perm).contiguous().permute(*inv)
    assert torch.equal(c.v_cache, v) and c.v_cache.stride() != c.k_cache.stride()
    run_checked(c)
    run_checked(c, num_kv_splits=2, block_n=16)


# ---- fresh random batches: every knob -----------------------------------------------------------------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    mode=st.sampled_from([M, E, V, X]),
    group=st.sampled_from([1, 4]),
    page=st.sampled_from([1, 16, 256]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    block_n=st.sampled_from([None, 16, 32]),
    block_m=st.sampled_from([None, 16]),
    splits=st.sampled_from([1, 2, 3]),
)
def test_random_batches_every_knob(data, mode, group, page, dtype, block_n, block_m, splits):
    bsz = data.draw(st.integers(1, 4))
    q_lens = [1] * bsz if mode == M else data.draw(st.lists(st.integers(1, 20), min_size=bsz, max_size=bsz))
    prefix = data.draw(st.lists(st.integers(0, 150), min_size=bsz, max_size=bsz))
    c = random_case(
        mode,
        q_lens,
        prefix,
        cfg(hq=2 * group, hkv=2, page=page, dtype=dtype),
        DEVICE,
        seed=data.draw(st.integers(0, 2**31 - 1)),
        mask_kind=data.draw(st.sampled_from(["tree", "random"])),
    )
    knobs = {k: v for k, v in dict(block_n=block_n, block_m=block_m).items() if v is not None}
    run_checked(c, num_kv_splits=splits, **knobs)


# ---- merge kernels against torch ------------------------------------------------------------------------
@pytest.mark.parametrize("block_h", [None, 2, 4])
@pytest.mark.parametrize("store_lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_splits_against_torch(store_lse, dtype, block_h):
    """Random partials with base-2 LSEs, some splits empty (-inf) and one row with no key at all;
    several heads a program (3 heads: the last program's extra heads masked); bf16 partials too."""
    g = torch.Generator().manual_seed(3)
    T, H, S, D = 7, 3, 5, 48
    part = torch.randn(T, H, S, D, generator=g)
    if dtype == torch.bfloat16 and block_h == 2:  # partials in the output dtype (cascade prefix parts)
        part = part.to(dtype).float()
    lse2 = torch.randn(T, H, S, generator=g) * 4
    lse2[torch.rand(T, H, S, generator=g) < 0.3] = -math.inf
    lse2[2] = -math.inf  # nothing anywhere: output 0, LSE -inf
    w = torch.softmax(lse2 * math.log(2), dim=-1).nan_to_num(0.0)
    want = (part * w[..., None]).sum(2)
    want_lse = torch.logsumexp(lse2 * math.log(2), dim=-1)
    out = torch.full((T, H, D), math.nan, dtype=dtype, device=DEVICE)
    lse = torch.full((T, H), math.nan, device=DEVICE) if store_lse else None
    p_in = part.to(dtype) if dtype == torch.bfloat16 and block_h == 2 else part
    merge_splits(p_in.to(DEVICE), lse2.to(DEVICE), out, lse, block_h=block_h)
    out, lse = out.cpu(), (lse.cpu() if store_lse else None)
    qo = torch.arange(T + 1)
    assert_close_per_request_head(out, want, qo, dtype, "merge_splits output")
    assert float(out[2].float().abs().max()) == 0.0
    if store_lse:
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert float((lse[fin] - want_lse[fin]).abs().max()) <= 1e-5


@pytest.mark.parametrize("block_h", [None, 8])
@pytest.mark.parametrize("with_lse", [True, False])
def test_merge_state_against_torch(with_lse, block_h):
    g = torch.Generator().manual_seed(4)
    T, H, D = 6, 4, 40
    va, vb = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    sa, sb = torch.randn(T, H, generator=g) * 3, torch.randn(T, H, generator=g) * 3
    sa[1], sb[2], sa[4], sb[4] = -math.inf, -math.inf, -math.inf, -math.inf  # empty states
    s = torch.logaddexp(sa, sb)
    wa, wb = torch.exp(sa - s).nan_to_num(0.0), torch.exp(sb - s).nan_to_num(0.0)
    want = va * wa[..., None] + vb * wb[..., None]
    vo = torch.full_like(va, math.nan, device=DEVICE)
    so = torch.full_like(sa, math.nan, device=DEVICE) if with_lse else None
    merge_state(va.to(DEVICE), sa.to(DEVICE), vb.to(DEVICE), sb.to(DEVICE), vo, so, block_h=block_h)
    vo, so = vo.cpu(), (so.cpu() if with_lse else None)
    assert_close_per_request_head(vo, want, torch.arange(T + 1), torch.float32, "merge_state output")
    if with_lse:
        fin = torch.isfinite(s)
        assert torch.equal(torch.isfinite(so), fin) and float((so[fin] - s[fin]).abs().max()) <= 1e-5
