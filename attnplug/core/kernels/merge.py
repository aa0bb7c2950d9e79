"""Merging partial attention states by their log-sum-exp (split-KV and cascade use it).

A state over a key set ``S`` is ``(v, s)``: the softmax-weighted value ``v`` and ``s = log sum exp``
of the logits over ``S``. Two states over disjoint key sets merge exactly:
``s = log(e^{s_a} + e^{s_b})``, ``v = v_a e^{s_a - s} + v_b e^{s_b - s}``. An empty state has
``s = -inf`` and contributes nothing (whatever its ``v`` holds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def merge_splits_kernel(
    P, PL, O, LSE, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_ot, stride_oh, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
    BASE: tl.constexpr,
):
    """Grid ``(T, H)``: merge ``num_splits`` partials ``P [T,H,S,D]`` fp32 with base-2 LSE
    ``PL [T,H,S]`` into ``O [T,H,D]`` (and natural-log ``LSE [T,H]``). With ``BASE``, ``O`` / ``LSE``
    already hold a state over other keys and the splits merge into it; a row whose splits are all
    empty is neither read nor written."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = sp < num_splits
    lse = tl.load(PL + t * stride_lt + h * stride_lh + sp, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    sb = float("-inf")
    if BASE:
        sb = tl.load(LSE + t * stride_st + h * stride_sh) * 1.4426950408889634
        m = tl.maximum(m, sb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    tot_splits = tl.sum(w, 0)
    # the partials load alongside the LSE (not after it); an empty split (weight 0) adds 0 whatever
    # its unwritten partial holds (NaN included): selected away, not multiplied
    p = tl.load(P + t * stride_pt + h * stride_ph + sp[:, None] * stride_ps + d[None, :],
                mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    acc = tl.sum(tl.where((w > 0.0)[:, None], p * w[:, None], 0.0), 0)
    tot = tot_splits
    need = d < HEAD_DIM
    if BASE:  # weights as vectors: a scalar bool `&` a vector mask is int32 in the interpreter
        zero = tl.zeros([BLOCK_D], tl.float32)
        need = need & (zero + tot_splits > 0.0)
        wb = tl.exp2(sb - m_safe)
        ob = tl.load(O + t * stride_ot + h * stride_oh + d, mask=need & (zero + wb > 0.0), other=0.0).to(tl.float32)
        acc += ob * wb
        tot += wb
    out = acc / tl.where(tot > 0.0, tot, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + d, out.to(O.dtype.element_ty), mask=need)
    if STORE_LSE:
        res = tl.where(tot > 0.0, (m_safe + tl.log2(tl.where(tot > 0.0, tot, 1.0))) * 0.6931471805599453, float("-inf"))
        if BASE:
            tl.store(LSE + t * stride_st + h * stride_sh, res, mask=tot_splits > 0.0)
        else:
            tl.store(LSE + t * stride_st + h * stride_sh, res)


@triton.jit
def merge_state_kernel(
    VA, SA, VB, SB, VO, SO, ROWS,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_sat, stride_sah, stride_sbt, stride_sbh, stride_sot, stride_soh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr, HAS_ROWS: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """Grid ``(T, H)``: merge two states with natural-log LSE (rows ``[T, H, D]``, LSE ``[T, H]``).
    With ``HAS_ROWS`` state A and the output are read/written at row ``ROWS[t]``, state B at ``t``.
    ``IN_PLACE`` (the output is state A): a row whose state B is empty is neither read nor written."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ta = t
    if HAS_ROWS:
        ta = tl.load(ROWS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    sa = tl.load(SA + ta * stride_sat + h * stride_sah) * 1.4426950408889634
    sb = tl.load(SB + t * stride_sbt + h * stride_sbh) * 1.4426950408889634
    m = tl.maximum(sa, sb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp2(sa - m_safe)
    wb = tl.exp2(sb - m_safe)
    tot = wa + wb
    zero = tl.zeros([BLOCK_D], tl.float32)  # weights as vectors: a scalar bool `&` a vector mask is int32 in the interpreter
    need = d_ok
    if IN_PLACE:
        need = d_ok & (zero + wb > 0.0)
    va = tl.load(VA + ta * stride_at + h * stride_ah + d, mask=need & (zero + wa > 0.0), other=0.0).to(tl.float32)
    vb = tl.load(VB + t * stride_bt + h * stride_bh + d, mask=need & (zero + wb > 0.0), other=0.0).to(tl.float32)
    inv = 1.0 / tl.where(tot > 0.0, tot, 1.0)
    # an empty state (weight 0) is not read: it adds nothing, whatever its scratch holds
    tl.store(VO + ta * stride_ot + h * stride_oh + d, ((va * wa + vb * wb) * inv).to(VO.dtype.element_ty), mask=need)
    if STORE_LSE:
        res = tl.where(tot > 0.0, (m_safe + tl.log2(tl.where(tot > 0.0, tot, 1.0))) * 0.6931471805599453, float("-inf"))
        if IN_PLACE:
            tl.store(SO + ta * stride_sot + h * stride_soh, res, mask=wb > 0.0)
        else:
            tl.store(SO + ta * stride_sot + h * stride_soh, res)


def merge_splits(partial: torch.Tensor, partial_lse2: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                 base: bool = False) -> None:
    """Merge split-KV partials.

    Args:
        partial: ``[T, H, S, D]`` float32 partial outputs.
        partial_lse2: ``[T, H, S]`` float32 base-2 LSE of each partial (contiguous in S).
        out: ``[T, H, D]`` output (any float dtype; last dim contiguous).
        lse: optional ``[T, H]`` float32, receives the natural-log LSE.
        base: ``out`` / ``lse`` (required) hold a state over a disjoint key set, and the splits merge
            into it in place; rows whose splits are all empty stay untouched.
    """
    T, H, S, D = partial.shape
    if T == 0:
        return
    if base and lse is None:
        raise ValueError("attnplug: merge_splits(base=True) merges into (out, lse): lse is required")
    merge_splits_kernel[(T, H)](
        partial, partial_lse2, out, lse if lse is not None else partial_lse2, S,
        partial.stride(0), partial.stride(1), partial.stride(2),
        partial_lse2.stride(0), partial_lse2.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_S=max(triton.next_power_of_2(S), 2),
        STORE_LSE=lse is not None, BASE=base, num_warps=4,
    )


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    v_out: torch.Tensor,
    s_out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> None:
    """Merge two attention states over disjoint key sets (natural-log LSE).

    Args:
        v_a, v_b: ``[T, H, D]`` partial outputs (last dim contiguous).
        s_a, s_b: ``[T, H]`` float32 natural-log LSE (any strides, e.g. a transposed ``[H, T]``).
        v_out: ``[T, H, D]`` result (may alias ``v_a``).
        s_out: optional ``[T, H]`` float32, receives the merged LSE (may alias ``s_a``).
        rows: optional ``[Tb]`` int64: merge only rows ``rows[i]`` of ``v_a / s_a / v_out / s_out``
            with row ``i`` of ``v_b / s_b [Tb, ...]`` (the cascade's prefix part); others untouched.
    """
    T, H, D = v_b.shape if rows is not None else v_a.shape
    if T == 0:
        return
    same = lambda x, y: x.data_ptr() == y.data_ptr() and x.stride() == y.stride()  # noqa: E731
    in_place = same(v_out, v_a) and (s_out is None or same(s_out, s_a))
    merge_state_kernel[(T, H)](
        v_a, s_a, v_b, s_b, v_out, s_out if s_out is not None else s_a, rows if rows is not None else s_a,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), v_out.stride(0), v_out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1),
        *((s_out.stride(0), s_out.stride(1)) if s_out is not None else (0, 0)),
        HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), STORE_LSE=s_out is not None, HAS_ROWS=rows is not None,
        IN_PLACE=in_place, num_warps=4,
    )
