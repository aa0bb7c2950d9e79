"""Triton ragged prefill: attention over K/V given per token (no cache), :mod:`attnplug.core.ragged`.

One program per (query tile, request, query head); keys in blocks, online softmax in base 2. The qk head
dim is two dots, its largest power of two and the rest (192 = 128 + 64), so nothing is padded there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import softmax_step

LOG2E = 1.4426950408889634


@triton.jit
def _key_block(
    q1, q2, m_i, l_i, acc, K, V, k_start, kvh, n0, m, hi, causal_off, qk_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One block of ``BLOCK_N`` keys from ``n0`` into the online-softmax state; ``MASKED``: keys ``>= hi`` and
    (``CAUSAL``) keys after ``m + causal_off`` hidden, else every key visible to every row."""
    n = n0 + tl.arange(0, BLOCK_N)
    d1 = tl.arange(0, D1)
    d2 = tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    n_ok = n < hi
    k_rows = K + (k_start + n).to(tl.int64)[None, :] * stride_kt + kvh * stride_kh
    v_rows = V + (k_start + n).to(tl.int64)[:, None] * stride_vt + kvh * stride_vh
    if MASKED:
        k1 = tl.load(k_rows + d1[:, None], mask=n_ok[None, :], other=0.0)
    else:
        k1 = tl.load(k_rows + d1[:, None])
    if UPCAST:
        k1 = k1.to(tl.float32)
    s = tl.dot(q1, k1, input_precision=DOT_PRECISION)
    if D2 > 0:
        k2_ok = d2[:, None] < D2
        if MASKED:
            k2_ok = k2_ok & n_ok[None, :]
        k2 = tl.load(k_rows + D1 + d2[:, None], mask=k2_ok, other=0.0)
        if UPCAST:
            k2 = k2.to(tl.float32)
        s = tl.dot(q2, k2, s, input_precision=DOT_PRECISION)
    s = s * qk_scale
    if MASKED:
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= m[:, None] + causal_off)
        s = tl.where(visible, s, float("-inf"))
    m_i, p, alpha, l_i = softmax_step(s, m_i, l_i)
    v_ok = dv[None, :] < DV
    if MASKED:
        v_ok = v_ok & n_ok[:, None]
    v = tl.load(v_rows + dv[None, :], mask=v_ok, other=0.0)
    p = p.to(v.dtype)
    if UPCAST:
        p, v = p.to(tl.float32), v.to(tl.float32)
    return m_i, l_i, tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)


@triton.jit
def ragged_prefill_kernel(
    Q,
    K,
    V,
    O,
    CU_Q,
    CU_K,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``Q [Tq, Hq, D1 + D2]``, ``K [Tk, Hkv, D1 + D2]``, ``V [Tk, Hkv, DV]`` -> ``O [Tq, Hq, DV]``;
    ``CU_Q`` / ``CU_K`` ``[B + 1]`` int32; causal: key ``n`` visible to query ``m`` iff
    ``n <= m + kv_len - q_len``. ``qk_scale``: softmax scale times log2(e). ``UPCAST``: fp32 dot operands
    (the CPU interpreter's ``tl.dot``); ``DOT_PRECISION``: ``"ieee"`` for float32 inputs. Key blocks every
    row of the tile sees run unmasked, the rest (the diagonal, the last partial block) masked."""
    tile, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    kv_len = tl.load(CU_K + b + 1) - k_start
    if tile * BLOCK_M >= q_len:
        return
    kvh = h // GROUP
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < q_len
    d1 = tl.arange(0, D1)
    d2 = tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = Q + (q_start + m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q1 = tl.load(q_rows + d1[None, :], mask=m_ok[:, None], other=0.0)
    q2 = q1  # unused unless D2 > 0
    if UPCAST:
        q1 = q1.to(tl.float32)
    if D2 > 0:
        q2 = tl.load(q_rows + D1 + d2[None, :], mask=m_ok[:, None] & (d2[None, :] < D2), other=0.0)
        if UPCAST:
            q2 = q2.to(tl.float32)
    hi = kv_len
    lo = kv_len
    causal_off = 0
    if CAUSAL:
        causal_off = kv_len - q_len
        hi = tl.minimum(kv_len, causal_off + (tile + 1) * BLOCK_M)
        lo = tl.minimum(kv_len, causal_off + tile * BLOCK_M + 1)  # keys every row of the tile sees
    lo = lo // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, lo, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q1, q2, m_i, l_i, acc, K, V, k_start, kvh, n0, m, hi, causal_off, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, D1, D2, BLOCK_D2, DV, BLOCK_DV, BLOCK_N,
            False, CAUSAL, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _key_block(
            q1, q2, m_i, l_i, acc, K, V, k_start, kvh, n0, m, hi, causal_off, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, D1, D2, BLOCK_D2, DV, BLOCK_DV, BLOCK_N,
            True, CAUSAL, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = O + (q_start + m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
    tl.store(o_rows + dv[None, :], out.to(O.dtype.element_ty), mask=m_ok[:, None] & (dv[None, :] < DV))


def head_dim_split(d: int) -> tuple[int, int, int]:
    """``(D1, D2, BLOCK_D2)``: ``D1`` the largest power of two <= ``d``, ``D2 = d - D1``, its block (a
    dot's side is at least 16)."""
    d1 = 1 << (int(d).bit_length() - 1)
    d2 = d - d1
    return d1, d2, max(16, triton.next_power_of_2(d2))


def ragged_prefill(
    q,
    k,
    v,
    out,
    cu_q,
    cu_k,
    max_q: int,
    scale: float,
    causal: bool,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Launch :func:`ragged_prefill_kernel` over ``cdiv(max_q, block_m) x B x Hq`` programs."""
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    d1, d2, bd2 = head_dim_split(d)
    grid = (triton.cdiv(max_q, block_m), cu_q.numel() - 1, hq)
    ragged_prefill_kernel[grid](
        q,
        k,
        v,
        out,
        cu_q,
        cu_k,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        D1=d1,
        D2=d2,
        BLOCK_D2=bd2,
        DV=dv,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        UPCAST=q.device.type == "cpu",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
