"""Triton kernels against the float32 reference: every mode, ragged batches, permuted pages.

On CPU these run under the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest); on a
CUDA machine the same tests run compiled kernels on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from batches import assert_close_per_request_head, random_case, rel_err, triton_launch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention
from attnplug.core.kernels.merge import merge_state
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(case, provider="triton", lse_too=True, **plan_kwargs):
    """Run ``provider`` on ``case`` and compare output (and LSE) with the reference."""
    attn = PagedAttention(case.config, provider, DEVICE)
    plan = attn.plan(case.batch, num_pages=case.num_pages, **plan_kwargs)
    attn.check_inputs(case.q, case.k_cache, case.v_cache)
    lse = torch.full((case.q.shape[0], case.config.num_qo_heads), math.nan, device=DEVICE) if lse_too else None
    out = torch.full_like(case.q, math.nan)
    attn.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse)
    ref, ref_lse = reference_attention(plan, case.q, case.k_cache, case.v_cache)
    assert not torch.isnan(out).any(), "NaN in output"
    assert_close_per_request_head(out, ref, case.batch.qo_indptr, case.config.dtype, f"{provider} vs reference")
    if lse_too:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), "LSE finiteness differs from reference"
        assert rel_err(lse[fin], ref_lse[fin]) <= 1e-4
    return plan


def cfg(hq=8, hkv=2, d=64, page=16, dtype=torch.bfloat16, **kw):
    return AttentionConfig(hq, hkv, d, page, dtype, **kw)


# ---- (a) split-KV paged decode with GQA head packing ----------------------------------------
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode(group, page, splits):
    c = random_case(
        ForwardMode.DECODE, [1] * 4, [0, 37, 16, 129], cfg(2 * group, 2, page=page), DEVICE, seed=group * page + splits
    )
    plan = check(c, num_kv_splits=splits)
    assert triton_launch(plan)["num_splits"] == splits


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_head_dims_dtypes(d, dtype):
    c = random_case(ForwardMode.DECODE, [1] * 3, [5, 70, 33], cfg(8, 2, d=d, dtype=dtype), DEVICE, seed=d)
    check(c, num_kv_splits=2)


# ---- (b) paged extend / prefill: prefix from pages + new tokens, causal ---------------------------
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16])
def test_extend(group, page):
    # empty prefix, prefix ending mid-page, prefix on a page boundary, a single-token extend
    c = random_case(
        ForwardMode.EXTEND, [23, 40, 9, 1], [0, 21, 32, 50], cfg(2 * group, 2, page=page), DEVICE, seed=7 + group
    )
    check(c)


@pytest.mark.parametrize("d,dtype", [(128, torch.float16), (256, torch.bfloat16), (96, torch.bfloat16)])
def test_extend_head_dims_dtypes(d, dtype):
    c = random_case(ForwardMode.PREFILL, [30, 17], [0, 3], cfg(4, 1, d=d, dtype=dtype), DEVICE, seed=d)
    check(c)


def test_mixed_batch_and_split_extend():
    c = random_case(ForwardMode.MIXED, [1, 19, 1, 5], [40, 13, 0, 60], cfg(8, 2), DEVICE, seed=3)
    check(c)
    check(c, num_kv_splits=4)  # splitting also works for multi-token tiles


def test_draft_extend_hnd_layout():
    c = random_case(ForwardMode.DRAFT_EXTEND, [3, 3, 3], [17, 2, 64], cfg(8, 4, kv_layout="HND"), DEVICE, seed=11)
    check(c)


def test_softcap_and_window_and_scale():
    c = random_case(
        ForwardMode.EXTEND,
        [31, 6],
        [20, 45],
        cfg(8, 2, logits_soft_cap=5.0, window_left=13, sm_scale=0.3),
        DEVICE,
        seed=5,
    )
    check(c)
    d = random_case(ForwardMode.DECODE, [1, 1], [90, 7], cfg(8, 2, logits_soft_cap=2.0, window_left=40), DEVICE, seed=6)
    check(d, num_kv_splits=3)


def test_non_causal_extend():
    c = random_case(ForwardMode.EXTEND, [12, 7], [5, 30], cfg(4, 2), DEVICE, seed=9)
    c.batch.causal = False
    check(c)


# ---- (c) custom mask: tree verify and random masks ---------------------------------------------
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page", [1, 16])
def test_target_verify_tree(group, page):
    c = random_case(
        ForwardMode.TARGET_VERIFY, [8, 5, 16], [30, 0, 47], cfg(2 * group, 2, page=page), DEVICE, seed=group + page
    )
    check(c)


def test_random_mask_with_splits():
    c = random_case(ForwardMode.TARGET_VERIFY, [6, 11], [50, 33], cfg(8, 2), DEVICE, seed=2, mask_kind="random")
    check(c)
    # BLOCK_N 16: 56 and 44 keys really spread over the 3 splits (test_kernel_paths checks where keys land)
    plan = check(c, num_kv_splits=3, block_n=16)
    assert triton_launch(plan)["num_splits"] == 3 and triton_launch(plan)["block_n"] == 16


def test_fully_masked_row_is_zero_not_nan():
    c = random_case(ForwardMode.TARGET_VERIFY, [4], [10], cfg(4, 2), DEVICE, seed=1)
    c.batch.custom_mask = c.batch.custom_mask.clone()
    c.batch.custom_mask[:14] = False  # query 0 sees nothing
    check(c)


# ---- fresh random ragged batches ------------------------------------------------------------------
@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    group=st.sampled_from([1, 4, 8]),
    page=st.sampled_from([1, 16]),
    mode=st.sampled_from([ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.MIXED]),
)
def test_random_batches(data, group, page, mode):
    bsz = data.draw(st.integers(1, 4))
    if mode == ForwardMode.DECODE:
        q_lens = [1] * bsz
    else:
        q_lens = data.draw(st.lists(st.integers(1, 24), min_size=bsz, max_size=bsz))
    prefix = data.draw(st.lists(st.integers(0, 80), min_size=bsz, max_size=bsz))
    seed = data.draw(st.integers(0, 2**31 - 1))
    c = random_case(mode, q_lens, prefix, cfg(2 * group, 2, page=page), DEVICE, seed=seed)
    check(c, num_kv_splits=data.draw(st.sampled_from([1, 2, 5])))


# ---- (d) merging states by LSE ------------------------------------------------------------------
def test_merge_state_equals_attention_over_union():
    """Attention over keys A∪B equals merge(attn over A, attn over B)."""
    torch.manual_seed(0)
    T, H, D, na, nb = 5, 3, 64, 17, 9
    q = torch.randn(T, H, D, device=DEVICE)
    k = torch.randn(na + nb, H, D, device=DEVICE)
    v = torch.randn(na + nb, H, D, device=DEVICE)

    def attn(ks, vs):
        s = torch.einsum("thd,nhd->thn", q, ks)
        return torch.einsum("thn,nhd->thd", s.softmax(-1), vs), torch.logsumexp(s, -1)

    va, sa = attn(k[:na], v[:na])
    vb, sb = attn(k[na:], v[na:])
    vf, sf = attn(k, v)
    sb[0] = -math.inf  # an empty state contributes nothing
    vb[0] = 0
    vf[0], sf[0] = va[0], sa[0]
    vo, so = torch.empty_like(va), torch.empty_like(sa)
    merge_state(va, sa.contiguous(), vb, sb.contiguous(), vo, so)
    assert rel_err(vo, vf) < 1e-5 and rel_err(so, sf) < 1e-5
    # LSE given transposed ([H, T] storage, as FA3 returns it) merges the same
    vo2, so2 = torch.empty_like(va), torch.empty(H, T, device=DEVICE).t()
    merge_state(va, sa.t().contiguous().t(), vb, sb.t().contiguous().t(), vo2, so2)
    assert rel_err(vo2, vf) < 1e-5 and rel_err(so2, sf) < 1e-5


@pytest.mark.parametrize("page", [1, 16])
def test_kv_start_restricts_keys(page):
    """``kv_start[b]``: attend only to keys >= kv_start (the draft-key part of a verify tree)."""
    c = random_case(ForwardMode.TARGET_VERIFY, [6, 4, 9], [33, 0, 17], cfg(8, 2, page=page), DEVICE, seed=page)
    attn = PagedAttention(c.config, "triton", DEVICE)
    q_lens = torch.tensor([6, 4, 9])
    kv_lens = torch.tensor([39, 4, 26])
    start = (kv_lens - q_lens).to(torch.int32)
    attn.plan(c.batch, num_pages=c.num_pages, kv_start=start.to(DEVICE))
    out = attn.run(c.q, c.k_cache, c.v_cache)
    # reference: the same mask with every key before kv_start hidden
    cut = c.batch.custom_mask.clone()
    off = 0
    for ql, kl, s0 in zip(q_lens.tolist(), kv_lens.tolist(), start.tolist()):
        cut[off : off + ql * kl].view(ql, kl)[:, :s0] = False
        off += ql * kl
    c.batch.custom_mask = cut
    ref, _ = reference_attention(
        PagedAttention(c.config, "reference", "cpu").plan(c.batch, num_pages=c.num_pages),
        c.q.cpu(),
        c.k_cache.cpu(),
        c.v_cache.cpu(),
    )
    assert_close_per_request_head(
        out, ref, c.batch.qo_indptr, c.config.dtype, "kv_start vs reference with the cut mask"
    )
