"""MLA kernels: absorbed attention over the latent paged cache, and the latent KV write.

The latent cache is ``[pages, P, R + Dr]`` (one KV head; :mod:`attnplug.core.mla`). Each program reads a
block of latent rows once and uses it twice: the scores ``q_nope . c + q_pe . k_pe`` (two dots, since
``R + Dr`` = 576 is no power of two) and the output ``p @ c`` (V = the first ``R`` columns). A program
covers ``BLOCK_Q`` query tokens x ``BLOCK_H`` heads of one request (decode: one token, the heads fill the
rows), one split of its keys; split partials go through :func:`~attnplug.core.kernels.merge.merge_splits`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import kv_offsets, softmax_step, tile_request
from .kv_write import fp8_constants, quantize_to_fp8


@triton.jit
def mla_attention_kernel(
    Q,
    C,
    O,
    LSE,
    QO_INDPTR,
    KV_INDPTR,
    KV_INDICES,
    KV_LENS,
    TILE_REQ,
    TILE_Q,
    MASK,
    MASK_INDPTR,
    KV_START,
    K_SCALE,
    sm_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_ct,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(tiles, cdiv(H, BLOCK_H), splits)``. ``Q [T, H, R + Dr]``, ``C`` the latent cache (page /
    token strides, last dim contiguous). Unsplit: ``O [T, H, R]`` and natural-log ``LSE [T, H]``
    (``STORE_LSE``); ``SPLIT``: ``O [T, H, S, R]`` partials (``stride_os``) and base-2 ``LSE [T, H, S]``
    (contiguous in S), ``-inf`` for an empty split."""
    tile = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    b, q0, q_start, q_len, kv_len, page_lo = tile_request(TILE_REQ, TILE_Q, QO_INDPTR, KV_LENS, KV_INDPTR, tile)

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    m_idx = tl.arange(0, BLOCK_M)
    tq = q0 + m_idx // BLOCK_H  # query token within the request
    h = hb * BLOCK_H + m_idx % BLOCK_H
    row_ok = (tq < q_len) & (h < NUM_HEADS)
    t = (q_start + tq).to(tl.int64)
    pos = kv_len - q_len + tq  # absolute position of each row's query

    rr = tl.arange(0, BLOCK_R)
    dr = tl.arange(0, BLOCK_DR)
    q_row = Q + t[:, None] * stride_qt + h[:, None] * stride_qh
    q_nope = tl.load(q_row + rr[None, :], mask=row_ok[:, None] & (rr[None, :] < R), other=0.0)
    q_pe = tl.load(q_row + R + dr[None, :], mask=row_ok[:, None] & (dr[None, :] < DR), other=0.0)
    if UPCAST:  # the Triton interpreter cannot dot 16-bit floats: compute in fp32 there
        q_nope, q_pe = q_nope.to(tl.float32), q_pe.to(tl.float32)

    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(KV_START + b)
    kv_hi = kv_len
    if CAUSAL:  # the tile's last query sees keys up to its position
        kv_hi = tl.minimum(kv_len, kv_len - q_len + q0 + BLOCK_Q)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), num_splits), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * chunk
    hi = tl.minimum(lo + chunk, kv_hi)

    mask_base = 0
    if HAS_MASK:
        mask_base = tl.load(MASK_INDPTR + b)
    scale2 = sm_scale * 1.4426950408889634
    kscale = 1.0
    if KV_FP8:
        kscale = tl.load(K_SCALE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        offs, key_ok = kv_offsets(KV_INDICES, page_lo, n0, 0, stride_cp, stride_ct, 0, hi, BLOCK_N, PAGE_SIZE, True)
        row = C + offs
        c = tl.load(row[:, None] + rr[None, :], mask=key_ok[:, None] & (rr[None, :] < R), other=0.0)
        pe = tl.load(row[:, None] + R + dr[None, :], mask=key_ok[:, None] & (dr[None, :] < DR), other=0.0)
        if KV_FP8:
            c = (c.to(tl.float32) * kscale).to(Q.dtype.element_ty)
            pe = (pe.to(tl.float32) * kscale).to(Q.dtype.element_ty)
        if UPCAST:
            c, pe = c.to(tl.float32), pe.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        s = s * scale2
        ok = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            ok = ok & (j[None, :] <= pos[:, None])
        if HAS_MASK:
            mv = tl.load(MASK + mask_base + tq[:, None].to(tl.int64) * kv_len + j[None, :], mask=ok, other=0)
            ok = ok & (mv != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new, p, alpha, l_i = softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ok = row_ok[:, None] & (rr[None, :] < R)
    if SPLIT:
        tl.store(
            O + t[:, None] * stride_ot + h[:, None] * stride_oh + split * stride_os + rr[None, :],
            out.to(O.dtype.element_ty),
            mask=o_ok,
        )
        tl.store(LSE + t * stride_lt + h * stride_lh + split, lse2, mask=row_ok)
    else:
        tl.store(
            O + t[:, None] * stride_ot + h[:, None] * stride_oh + rr[None, :], out.to(O.dtype.element_ty), mask=o_ok
        )
        if STORE_LSE:
            tl.store(LSE + t * stride_lt + h * stride_lh, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def write_latent_kernel(
    KVC,
    KPE,
    CACHE,
    SLOT,
    page_size,
    K_SCALE,
    stride_ct,
    stride_pt,
    stride_cp,
    stride_co,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
):
    """Grid ``(T,)``: token ``t`` -> latent row ``SLOT[t]`` (``< 0``: skipped) = ``cat(KVC[t], KPE[t])``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    row = CACHE + (slot // page_size) * stride_cp + (slot % page_size) * stride_co
    rr = tl.arange(0, BLOCK_R)
    dr = tl.arange(0, BLOCK_DR)
    # padding: the bound, not `& keep` (a block mask with a scalar bool is refused by the 3.9 interpreter)
    m_c = rr < tl.where(keep, R, 0)
    m_p = dr < tl.where(keep, DR, 0)
    c = tl.load(KVC + t * stride_ct + rr, mask=m_c)
    pe = tl.load(KPE + t * stride_pt + dr, mask=m_p)
    if FP8:
        scale = tl.load(K_SCALE)
        c = quantize_to_fp8(c, scale, FP8_MAX, MANT, MIN_NORMAL, SUB_MAGIC)
        pe = quantize_to_fp8(pe, scale, FP8_MAX, MANT, MIN_NORMAL, SUB_MAGIC)
    tl.store(row + rr, c.to(CACHE.dtype.element_ty), mask=m_c)
    tl.store(row + R + dr, pe.to(CACHE.dtype.element_ty), mask=m_p)


def write_latent_paged(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> None:
    """:func:`attnplug.core.mla.write_latent` (see there): one launch of :func:`write_latent_kernel`."""
    T = slot_mapping.shape[0]
    if T == 0:
        return
    if k_pe.dim() == 3:
        k_pe = k_pe.squeeze(1)
    if cache.dim() == 4:
        cache = cache.squeeze(2)
    R, DR = kv_c.shape[-1], k_pe.shape[-1]
    if cache.dim() != 3 or cache.shape[-1] != R + DR:
        raise ValueError(f"attnplug: the MLA latent cache must be [pages, P, {R + DR}], got {list(cache.shape)}")
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe), ("cache", cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"attnplug: {name} must have a contiguous last dim, got strides {x.stride()}")
    fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8 and k_scale is None:
        raise ValueError("attnplug: an fp8 MLA latent write needs k_scale (one-element float32 tensor)")
    consts = fp8_constants(cache.dtype) if fp8 else dict(FP8_MAX=0.0, MANT=0, MIN_NORMAL=0.0, SUB_MAGIC=0.0)
    write_latent_kernel[(T,)](
        kv_c,
        k_pe,
        cache,
        slot_mapping,
        cache.shape[1],
        k_scale if fp8 else slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        R=R,
        DR=DR,
        BLOCK_R=triton.next_power_of_2(R),
        BLOCK_DR=triton.next_power_of_2(DR),
        FP8=fp8,
        **consts,
    )
