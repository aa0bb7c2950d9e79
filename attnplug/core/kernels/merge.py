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

from .pdl import gdc_wait


@triton.jit
def _natural_lse(tot, m_safe):
    """Natural-log LSE of a merged state: weight sum ``tot`` at base-2 maximum ``m_safe``; -inf where empty."""
    return tl.where(tot > 0.0, (m_safe + tl.log2(tl.where(tot > 0.0, tot, 1.0))) * 0.6931471805599453, float("-inf"))


@triton.jit
def merge_splits_kernel(
    P,
    PL,
    O,
    LSE,
    num_splits,
    num_heads,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_st,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BASE: tl.constexpr,
    PDL: tl.constexpr = False,
    SINKS=None,
    HAS_SINKS: tl.constexpr = False,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: merge ``num_splits`` partials ``P [T,H,S,D]`` (fp32 or the
    output dtype) with base-2 LSE ``PL [T,H,S]`` into ``O [T,H,D]`` (and natural-log ``LSE [T,H]``),
    ``BLOCK_H`` heads a program. With ``BASE``, ``O`` / ``LSE`` already hold a state over other keys
    and the splits merge into it; a row whose splits are all empty is not written. ``PDL`` (launched
    with ``launch_pdl=True``): waits for the kernel before it (:mod:`.pdl`) before reading anything.
    ``HAS_SINKS``: ``SINKS [H]`` sink logits join as one more state with no value row (every row written)."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = h_ok[:, None] & (sp[None, :] < num_splits)
    lse = tl.load(PL + t * stride_lt + h[:, None] * stride_lh + sp[None, :], mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:
        sink2 = tl.load(SINKS + h, mask=h_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    go = True
    if BASE:  # a program whose splits are all empty leaves the base state as it is: one load, no more
        go = tl.max(m, 0) > float("-inf")
    if go:
        sb = tl.full([BLOCK_H], float("-inf"), tl.float32)
        if BASE:
            sb = tl.load(LSE + t * stride_st + h * stride_sh, mask=h_ok, other=float("-inf")) * 1.4426950408889634
            m = tl.maximum(m, sb)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        # one [BLOCK_H, D] load a split and its [BLOCK_H] LSE, none waiting for the max (a split past
        # num_splits re-reads the last one, weight 0); an empty split (LSE -inf) is not read (its
        # partial may be unwritten, NaN included) and adds 0: masked and selected away, not multiplied
        d_ok = h_ok[:, None] & (d[None, :] < HEAD_DIM)
        p_row = P + t * stride_pt + h[:, None] * stride_ph + d[None, :]
        l_row = PL + t * stride_lt + h * stride_lh
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        tot_splits = tl.zeros([BLOCK_H], tl.float32)
        for s in tl.static_range(BLOCK_S):
            s_rd = tl.minimum(s, num_splits - 1)
            ls = tl.load(l_row + s_rd, mask=h_ok, other=float("-inf"))
            p = tl.load(p_row + s_rd * stride_ps, mask=d_ok & (ls > float("-inf"))[:, None], other=0.0).to(tl.float32)
            ws = tl.where((tl.zeros([BLOCK_H], tl.int32) + s) < num_splits, tl.exp2(ls - m_safe), 0.0)
            acc += tl.where((ws > 0.0)[:, None], p * ws[:, None], 0.0)
            tot_splits += ws
        tot = tot_splits
        if HAS_SINKS:
            tot_splits += tl.exp2(sink2 - m_safe)  # a row of empty splits still gets (0, sink)
            tot = tot_splits
        need = d_ok
        if BASE:
            need = need & (tot_splits > 0.0)[:, None]
            wb = tl.exp2(sb - m_safe)
            ob = tl.load(O + t * stride_ot + h[:, None] * stride_oh + d[None, :], mask=d_ok, other=0.0).to(tl.float32)
            acc += tl.where((wb > 0.0)[:, None], ob * wb[:, None], 0.0)  # an empty base (NaN included) adds 0
            tot += wb
        out = acc / tl.where(tot > 0.0, tot, 1.0)[:, None]
        tl.store(O + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=need)
        if STORE_LSE:
            lse_ok = h_ok
            if BASE:  # rows whose splits are all empty keep the base's LSE
                lse_ok = lse_ok & (tot_splits > 0.0)
            tl.store(LSE + t * stride_st + h * stride_sh, _natural_lse(tot, m_safe), mask=lse_ok)


@triton.jit
def merge_state_kernel(
    VA,
    SA,
    VB,
    SB,
    VO,
    SO,
    ROWS,
    num_heads,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_sat,
    stride_sah,
    stride_sbt,
    stride_sbh,
    stride_sot,
    stride_soh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: merge two states with natural-log LSE (rows ``[T, H, D]``, LSE
    ``[T, H]``), ``BLOCK_H`` heads a program. With ``HAS_ROWS`` state A and the output are read/written
    at row ``ROWS[t]``, state B at ``t``. ``IN_PLACE`` (the output is state A): a row whose state B is
    empty is neither read nor written."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    ta = t
    if HAS_ROWS:
        ta = tl.load(ROWS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    sa = tl.load(SA + ta * stride_sat + h * stride_sah, mask=h_ok, other=float("-inf")) * 1.4426950408889634
    sb = tl.load(SB + t * stride_sbt + h * stride_sbh, mask=h_ok, other=float("-inf")) * 1.4426950408889634
    m = tl.maximum(sa, sb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp2(sa - m_safe)
    wb = tl.exp2(sb - m_safe)
    tot = wa + wb
    need = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    if IN_PLACE:
        need = need & (wb > 0.0)[:, None]
    va = tl.load(
        VA + ta * stride_at + h[:, None] * stride_ah + d[None, :], mask=need & (wa > 0.0)[:, None], other=0.0
    ).to(tl.float32)
    vb = tl.load(
        VB + t * stride_bt + h[:, None] * stride_bh + d[None, :], mask=need & (wb > 0.0)[:, None], other=0.0
    ).to(tl.float32)
    inv = 1.0 / tl.where(tot > 0.0, tot, 1.0)
    # an empty state (weight 0) is not read: it adds nothing, whatever its scratch holds
    tl.store(
        VO + ta * stride_ot + h[:, None] * stride_oh + d[None, :],
        ((va * wa[:, None] + vb * wb[:, None]) * inv[:, None]).to(VO.dtype.element_ty),
        mask=need,
    )
    if STORE_LSE:
        lse_ok = h_ok
        if IN_PLACE:  # rows without state b keep state a's LSE
            lse_ok = lse_ok & (wb > 0.0)
        tl.store(SO + ta * stride_sot + h * stride_soh, _natural_lse(tot, m_safe), mask=lse_ok)


#: A merge program takes whole heads, as many as keep at least this many programs and at most
#: :data:`MERGE_ELEMS` partial elements each (one head a program below that many rows x heads).
MERGE_MIN_PROGRAMS = 512
MERGE_ELEMS = 4096


def heads_per_program(rows: int, heads: int, elems_per_head: int) -> int:
    """``BLOCK_H`` of the merge kernels: a power of two, 1 unless ``rows * heads`` leaves at least
    :data:`MERGE_MIN_PROGRAMS` programs of up to :data:`MERGE_ELEMS` elements."""
    bh = 1
    while (
        bh * 2 <= heads
        and rows * triton.cdiv(heads, bh * 2) >= MERGE_MIN_PROGRAMS
        and bh * 2 * elems_per_head <= MERGE_ELEMS
    ):
        bh *= 2
    return bh


def merge_splits(
    partial: torch.Tensor,
    partial_lse2: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    base: bool = False,
    block_h: int | None = None,
    num_warps: int = 4,
    pdl: bool = False,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge split-KV partials.

    Args:
        partial: ``[T, H, S, D]`` partial outputs, float32 or ``out``'s dtype.
        partial_lse2: ``[T, H, S]`` float32 base-2 LSE of each partial (contiguous in S).
        out: ``[T, H, D]`` output (any float dtype; last dim contiguous).
        lse: optional ``[T, H]`` float32, receives the natural-log LSE.
        base: ``out`` / ``lse`` (required) hold a state over a disjoint key set, and the splits merge
            into it in place; rows whose splits are all empty stay untouched.
        block_h: heads a program (a power of two); ``None``: :func:`heads_per_program`.
        num_warps: warps a program.
        pdl: launched as a programmatic dependent of the kernel before it (:mod:`.pdl`; CUDA sm90+ only).
        sinks: ``[H]`` sink logits: each row's softmax counts its head's sink once, here (the partials
            carry none).
    """
    T, H, S, D = partial.shape
    if T == 0:
        return
    if base and lse is None:
        raise ValueError("attnplug: merge_splits(base=True) merges into (out, lse): lse is required")
    bs = max(triton.next_power_of_2(S), 2)
    bh = block_h or heads_per_program(T, H, bs * triton.next_power_of_2(D))
    merge_splits_kernel[(T, triton.cdiv(H, bh))](
        partial,
        partial_lse2,
        out,
        lse if lse is not None else partial_lse2,
        S,
        H,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        partial_lse2.stride(0),
        partial_lse2.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_S=bs,
        BLOCK_H=bh,
        STORE_LSE=lse is not None,
        BASE=base,
        num_warps=num_warps,
        **({"PDL": True, "launch_pdl": True} if pdl else {}),
        **({"SINKS": sinks, "HAS_SINKS": True} if sinks is not None else {}),
    )


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    v_out: torch.Tensor,
    s_out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    block_h: int | None = None,
) -> None:
    """Merge two attention states over disjoint key sets (natural-log LSE).

    Args:
        v_a, v_b: ``[T, H, D]`` partial outputs (last dim contiguous).
        s_a, s_b: ``[T, H]`` float32 natural-log LSE (any strides, e.g. a transposed ``[H, T]``).
        v_out: ``[T, H, D]`` result (may alias ``v_a``).
        s_out: optional ``[T, H]`` float32, receives the merged LSE (may alias ``s_a``).
        rows: optional ``[Tb]`` int64: merge only rows ``rows[i]`` of ``v_a / s_a / v_out / s_out``
            with row ``i`` of ``v_b / s_b [Tb, ...]`` (the cascade's prefix part); others untouched.
        block_h: heads a program (a power of two); ``None``: :func:`heads_per_program`.
    """
    T, H, D = v_b.shape if rows is not None else v_a.shape
    if T == 0:
        return
    same = lambda x, y: x.data_ptr() == y.data_ptr() and x.stride() == y.stride()  # noqa: E731
    in_place = same(v_out, v_a) and (s_out is None or same(s_out, s_a))
    bh = block_h or heads_per_program(T, H, 2 * triton.next_power_of_2(D))
    merge_state_kernel[(T, triton.cdiv(H, bh))](
        v_a,
        s_a,
        v_b,
        s_b,
        v_out,
        s_out if s_out is not None else s_a,
        rows if rows is not None else s_a,
        H,
        v_a.stride(0),
        v_a.stride(1),
        v_b.stride(0),
        v_b.stride(1),
        v_out.stride(0),
        v_out.stride(1),
        s_a.stride(0),
        s_a.stride(1),
        s_b.stride(0),
        s_b.stride(1),
        *((s_out.stride(0), s_out.stride(1)) if s_out is not None else (0, 0)),
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_H=bh,
        STORE_LSE=s_out is not None,
        HAS_ROWS=rows is not None,
        IN_PLACE=in_place,
        num_warps=4,
    )


@triton.jit
def apply_sinks_kernel(
    O,
    LSE,
    SINKS,
    num_heads,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: the sink logit ``SINKS[h]`` joins the state ``(O [T, H, D],
    LSE [T, H])`` (natural log) in place: ``O *= sigmoid(LSE - sink)``, ``LSE = logaddexp(LSE, sink)``.
    A row without keys (``LSE = -inf``) becomes ``(0, sink)`` whatever its ``O`` held."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = tl.arange(0, BLOCK_D)
    s = tl.load(LSE + t * stride_lt + h * stride_lh, mask=h_ok, other=0.0)
    k = tl.load(SINKS + h, mask=h_ok, other=0.0).to(tl.float32)
    m = tl.maximum(s, k)
    e = tl.exp(-tl.abs(s - k))  # exp(min - max), in [0, 1]; s = -inf: 0
    w = tl.where(s >= k, 1.0 / (1.0 + e), e / (1.0 + e))  # sigmoid(s - k), no overflow either way
    ok = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    o_ptrs = O + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    o = tl.load(o_ptrs, mask=ok & (w > 0.0)[:, None], other=0.0).to(tl.float32)
    tl.store(o_ptrs, tl.where((w > 0.0)[:, None], o * w[:, None], 0.0).to(O.dtype.element_ty), mask=ok)
    tl.store(LSE + t * stride_lt + h * stride_lh, m + tl.log(1.0 + e), mask=h_ok)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Join per-head sink logits to finished attention states in place (exact: the sink is one more
    softmax term with no value row).

    Args:
        out: ``[T, H, D]`` attention output over the keys (last dim contiguous).
        lse: ``[T, H]`` float32 natural-log LSE over the same keys (any strides); receives
            ``logaddexp(lse, sink)``.
        sinks: ``[H]`` sink logits (float32 or 16-bit), contiguous.
    """
    T, H, D = out.shape
    if T == 0:
        return
    bh = heads_per_program(T, H, triton.next_power_of_2(D))
    apply_sinks_kernel[(T, triton.cdiv(H, bh))](
        out,
        lse,
        sinks,
        H,
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_H=bh,
        num_warps=4,
    )
