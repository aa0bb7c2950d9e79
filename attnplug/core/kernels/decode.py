"""Triton split-KV decode over a paged KV cache with the merge fused in: the long-context decode path of
the triton provider (one query token per request; no custom mask, no ``kv_start``).

Grid ``(B, Hkv, S)``: request, KV head, split. A program holds the ``GROUP`` query heads of its KV
head in the rows of a ``[BLOCK_M, D]`` tile (GQA packing, as in :mod:`.attention`) and streams its
split's keys in ``BLOCK_N`` blocks. Every key before ``kv_len`` is visible to a decode token, so the
loop runs without any mask; only the last, ragged block of the last split is masked. The loop is a
``tl.range`` with ``NUM_STAGES``: K/V are gathered through the page table (page id, then the rows),
a two-load chain for Triton's pipeliner, which keeps ``(NUM_STAGES - 1) // 2`` blocks in flight per
program (so 5-7 stages, not 2-3, give a decode program blocks to stream while it computes).

Splits (``SPLIT``): each program writes its partial output (fp32) and base-2 LSE to the workspace.
``FUSED_MERGE``: then it bumps the ``(request, KV head)`` counter; the program that arrives last
merges the partials of its heads into ``O`` (and ``LSE``). Each split covers ``chunk`` keys (the
request's keys over ``S``, rounded up to ``BLOCK_N``), so a request with fewer keys than the ``S``
its graph was captured for has ``active = cdiv(keys, chunk) < S`` splits: with ``FUSED_MERGE`` the
others return at once (no partial, no arrival) and the last of the ``active`` merges them and puts
the counter back to 0, so the counters are zero again after every launch: no host work, no memset,
safe to capture in a CUDA graph (the counters are static memory, zeroed once at allocation).
Without ``FUSED_MERGE`` the provider runs :func:`.merge.merge_splits` after this kernel.

Window (``WINDOW``): the decode token at ``kv_len - 1`` sees keys from ``kv_len - 1 - window_left``:
just a lower bound, no mask. Soft cap, fp8 KV (``KV_FP8``, scales and ``FP8_F16`` as in :mod:`.attention`) and the
interpreter's fp32 dots (``UPCAST``) as in the other kernels.

fp8 byte pairs (``PAIRS``, power-of-two head dims): K and V rows are read as 16-bit words ``[BLOCK_N, D / 2]``
(word ``j`` = dims ``2j``, ``2j+1``) and split into their even and odd dims, so ``q . k = q_e . k_e +
q_o . k_o`` and ``P @ V`` fills the output's even and odd dims in two accumulators (the same MMA
count). Read as fp8 bytes, an operand of the fp16 tensor-core dots needs two bytes of *different*
keys in one register (V, whose keys are rows) or of non-adjacent shared-memory bytes (K): a byte
gather per pair, a large share of the loop's instructions on sm90 (``docs/measured-choices.md``). As words, the
hardware's (transposing)
matrix loads deliver them and one byte permute plus one ``cvt.rn.f16x2`` per pair converts them
(``FP8_F16`` dots; the interpreter and bf16 dots take the same words through integer ops).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import sink_state
from .common import kv_offsets
from .prefill import attend_block, softmax_update


@triton.constexpr_function
def pow2_at_least(n: int) -> int:
    """The next power of two >= ``n``, at compile time inside a kernel. attnplug's own rather than
    ``triton.next_power_of_2``: SGLang replaces that attribute with a plain function at import
    (``sglang/srt/utils/common.py``), which a kernel may not call."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@triton.jit
def decode_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    PO,
    PL,
    COUNTERS,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    K_SCALE,
    V_SCALE,
    sm_scale,
    soft_cap,
    window_left,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_plt,
    stride_plh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_S: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_F16: tl.constexpr = False,
    PAIRS: tl.constexpr = False,
    SINKS=None,
    HAS_SINKS: tl.constexpr = False,
):
    """Grid ``(B, Hkv, num_splits)``. Q ``[T, Hq, D]`` (request ``b``'s token at ``qo_indptr[b]``, none
    when its ``q_len`` is 0); O ``[T, Hq, D]``; LSE ``[T, Hq]`` natural log (``STORE_LSE``).
    ``SPLIT``: PO ``[T, Hq, S, D]`` fp32 partials, PL ``[T, Hq, S]`` base-2 LSE; ``FUSED_MERGE``:
    COUNTERS ``[B * Hkv]`` int32, zero before and after the launch; ``MERGE_S`` = next power of 2 of
    ``num_splits``, ``MERGE_CHUNK`` splits merged per step. ``HAS_SINKS``: ``SINKS [Hq]`` sink logits join
    each row's softmax: in the program's state when unsplit, in the fused merge when split (partials
    carry none; without ``FUSED_MERGE``, :func:`.merge.merge_splits` adds it)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    t = tl.load(qo_indptr + b)
    has_q = tl.load(qo_indptr + b + 1) > t  # a request without a query token writes nothing
    kv_len = tl.where(has_q, tl.load(kv_lens + b), 0)
    page_base = tl.load(kv_indptr + b)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < tl.where(has_q, GROUP, 0)  # not `& has_q`: the 3.9 interpreter rejects block & scalar bool masks
    head = kvh * GROUP + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t64 = t.to(tl.int64)
    q = tl.load(
        Q + t64 * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if KV_FP8 and FP8_F16:  # fp16 dots on q * sm_scale (see :mod:`.attention`)
        q = (q.to(tl.float32) * sm_scale).to(tl.float16)
        sm_scale = 1.0
    P_DTYPE: tl.constexpr = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale
    if not SOFT_CAP:
        qk_scale = sm_scale * 1.4426950408889634
    if KV_FP8:
        qk_scale = qk_scale * tl.load(K_SCALE)

    lo = 0
    if WINDOW:
        lo = tl.maximum(0, kv_len - 1 - window_left)
    hi = kv_len
    active = 1
    if SPLIT:
        span = tl.maximum(hi - lo, 0)
        chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        active = tl.maximum(1, tl.cdiv(span, tl.maximum(chunk, 1)))
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)
    # FUSED_MERGE: a split past the request's keys (a graph captured for longer contexts) does nothing;
    # the merge takes the `active` ones (the separate merge reads every split's LSE: each writes one)
    limit = num_splits
    if FUSED_MERGE:
        limit = active
    if split < limit:
        _decode_split(
            q,
            K,
            V,
            O,
            LSE,
            PO,
            PL,
            COUNTERS,
            kv_indices,
            K_SCALE,
            V_SCALE,
            page_base,
            lo,
            hi,
            b,
            kvh,
            split,
            active,
            t64,
            head,
            rows,
            row_ok,
            d,
            d_ok,
            has_q,
            qk_scale,
            soft_cap,
            stride_kp,
            stride_kt,
            stride_kh,
            stride_vp,
            stride_vt,
            stride_vh,
            stride_ot,
            stride_oh,
            stride_lt,
            stride_lh,
            stride_pt,
            stride_ph,
            stride_ps,
            stride_plt,
            stride_plh,
            GROUP,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            BLOCK_D,
            PAGE_SIZE,
            SOFT_CAP,
            SPLIT,
            FUSED_MERGE,
            MERGE_S,
            MERGE_CHUNK,
            NUM_STAGES,
            STORE_LSE,
            DOT_PRECISION,
            UPCAST,
            KV_FP8,
            P_DTYPE,
            PAIRS,
            SINKS,
            HAS_SINKS,
        )


@triton.jit
def _split_pairs_f16(w, E5M2: tl.constexpr):
    """16-bit words of two fp8 bytes (dims ``2j``, ``2j+1``) -> (even, odd) as fp16, two words a
    register: ``prmt`` gathers the two words' even (odd) bytes, ``cvt.rn.f16x2`` converts the pair."""
    CVT: tl.constexpr = "cvt.rn.f16x2.e5m2x2" if E5M2 else "cvt.rn.f16x2.e4m3x2"
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x0020; mov.b32 {lo, hi}, t; " + CVT + " $0, lo; "
        "prmt.b32 t, $2, 0, 0x0031; mov.b32 {lo, hi}, t; " + CVT + " $1, lo; }",
        "=r,=r,r",
        [w],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _load_pairs(X, off, ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows ``off`` (fp8 offsets) of ``X`` as 16-bit words, dims ``2j, 2j+1`` of a key in word ``j``:
    ``[BLOCK, D / 2]``, or ``[D / 2, BLOCK]`` (``TRANSPOSED``). Keys past ``hi`` (``MASKED``): zero words
    (no fp8 NaN pattern reaches a product)."""
    X16 = X.to(tl.pointer_type(tl.uint16), bitcast=True)
    j = tl.arange(0, HEAD_DIM // 2)
    if TRANSPOSED:
        ptr = X16 + (off >> 1)[None, :] + j[:, None]
        if MASKED:
            w = tl.load(ptr, mask=ok[None, :], other=0)
        else:
            w = tl.load(ptr)
    else:
        ptr = X16 + (off >> 1)[:, None] + j[None, :]
        if MASKED:
            w = tl.load(ptr, mask=ok[:, None], other=0)
        else:
            w = tl.load(ptr)
    return w


@triton.jit
def _split_words(w, FP8: tl.constexpr, P_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """16-bit words of two fp8 bytes -> (even bytes, odd bytes) in ``P_DTYPE`` (fp32 under ``UPCAST``)."""
    if UPCAST or P_DTYPE != tl.float16:
        e = (w & 0xFF).to(tl.uint8).to(FP8, bitcast=True).to(P_DTYPE)
        o = (w >> 8).to(tl.uint8).to(FP8, bitcast=True).to(P_DTYPE)
        if UPCAST:
            e = e.to(tl.float32)
            o = o.to(tl.float32)
    else:
        e, o = _split_pairs_f16(w, FP8 == tl.float8e5)
    return e, o


@triton.jit
def _attend_block_pairs(
    q_e,
    q_o,
    K,
    V,
    kv_indices,
    page_base,
    n0,
    kvh,
    hi,
    m_i,
    l_i,
    acc_e,
    acc_o,
    qk_scale,
    soft_cap,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    P_DTYPE: tl.constexpr,
):
    """:func:`.prefill.attend_block` for fp8 K/V read as byte pairs (``PAIRS``): keys as 16-bit words
    (:func:`_load_pairs`) split into their even and odd dims; ``q . k = q_e . k_e + q_o . k_o`` and
    the even / odd output dims in ``acc_e`` / ``acc_o`` ``[BLOCK_M, D / 2]``. A word is 16-bit data to
    the tensor cores' operand loads (consecutive keys in one register, the hardware's transposing
    load), where fp8 bytes take a byte gather per pair."""
    FP8: tl.constexpr = K.dtype.element_ty
    off, ok = kv_offsets(kv_indices, page_base, n0, kvh, stride_kp, stride_kt, stride_kh, hi, BLOCK, PAGE_SIZE, MASKED)
    k_e, k_o = _split_words(_load_pairs(K, off, ok, MASKED, HEAD_DIM, True), FP8, P_DTYPE, UPCAST)
    s = tl.dot(q_e, k_e, input_precision=DOT_PRECISION)
    s = tl.dot(q_o, k_o, s, input_precision=DOT_PRECISION)
    m_new, l_i, p, alpha = softmax_update(s, n0, hi, 0, m_i, l_i, qk_scale, soft_cap, BLOCK, MASKED, False, SOFT_CAP)
    off, ok = kv_offsets(kv_indices, page_base, n0, kvh, stride_vp, stride_vt, stride_vh, hi, BLOCK, PAGE_SIZE, MASKED)
    v_e, v_o = _split_words(_load_pairs(V, off, ok, MASKED, HEAD_DIM, False), FP8, P_DTYPE, UPCAST)
    p = p.to(P_DTYPE)
    if UPCAST:
        p = p.to(tl.float32)
    acc_e = tl.dot(p, v_e, acc_e * alpha[:, None], input_precision=DOT_PRECISION)
    acc_o = tl.dot(p, v_o, acc_o * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _decode_split(
    q,
    K,
    V,
    O,
    LSE,
    PO,
    PL,
    COUNTERS,
    kv_indices,
    K_SCALE,
    V_SCALE,
    page_base,
    lo,
    hi,
    b,
    kvh,
    split,
    active,
    t64,
    head,
    rows,
    row_ok,
    d,
    d_ok,
    has_q,
    qk_scale,
    soft_cap,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_plt,
    stride_plh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_S: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    P_DTYPE: tl.constexpr,
    PAIRS: tl.constexpr,
    SINKS,
    HAS_SINKS: tl.constexpr,
):
    """Keys ``[lo, hi)`` of request ``b``'s token for the heads of ``kvh``: the output (unsplit), or
    split ``split``'s partial, then (``FUSED_MERGE``) the merge of the ``active`` splits by the last to
    arrive."""
    full_hi = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS and not SPLIT:  # the sink's (base-2) logit with weight 1; split partials carry none
        m_i, l_i = sink_state(SINKS, head, l_i)
    if PAIRS:  # fp8 K/V as byte pairs: q and the output in even / odd dims
        q_e, q_o = tl.split(tl.reshape(q, [BLOCK_M, HEAD_DIM // 2, 2]))
        acc_e = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
        acc_o = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
        for n0 in tl.range(lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc_e, acc_o = _attend_block_pairs(
                q_e,
                q_o,
                K,
                V,
                kv_indices,
                page_base,
                n0,
                kvh,
                hi,
                m_i,
                l_i,
                acc_e,
                acc_o,
                qk_scale,
                soft_cap,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                BLOCK_N,
                HEAD_DIM,
                PAGE_SIZE,
                False,
                SOFT_CAP,
                DOT_PRECISION,
                UPCAST,
                P_DTYPE,
            )
        if full_hi < hi:
            m_i, l_i, acc_e, acc_o = _attend_block_pairs(
                q_e,
                q_o,
                K,
                V,
                kv_indices,
                page_base,
                full_hi,
                kvh,
                hi,
                m_i,
                l_i,
                acc_e,
                acc_o,
                qk_scale,
                soft_cap,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                BLOCK_N,
                HEAD_DIM,
                PAGE_SIZE,
                True,
                SOFT_CAP,
                DOT_PRECISION,
                UPCAST,
                P_DTYPE,
            )
        acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_M, BLOCK_D])  # dim 2j + parity
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in tl.range(lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc = attend_block(
                q,
                K,
                V,
                K,
                V,
                kv_indices,
                page_base,
                n0,
                kvh,
                hi,
                rows,
                d,
                m_i,
                l_i,
                acc,
                qk_scale,
                soft_cap,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                BLOCK_N,
                HEAD_DIM,
                PAGE_SIZE,
                False,
                False,
                False,
                SOFT_CAP,
                DOT_PRECISION,
                UPCAST,
                KV_FP8,
                P_DTYPE,
            )
        if full_hi < hi:  # the ragged last block
            m_i, l_i, acc = attend_block(
                q,
                K,
                V,
                K,
                V,
                kv_indices,
                page_base,
                full_hi,
                kvh,
                hi,
                rows,
                d,
                m_i,
                l_i,
                acc,
                qk_scale,
                soft_cap,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                BLOCK_N,
                HEAD_DIM,
                PAGE_SIZE,
                False,
                True,
                False,
                SOFT_CAP,
                DOT_PRECISION,
                UPCAST,
                KV_FP8,
                P_DTYPE,
            )

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(V_SCALE)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if not SPLIT:
        tl.store(
            O + t64 * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(O.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        if STORE_LSE:
            tl.store(LSE + t64 * stride_lt + head * stride_lh, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        tl.store(
            PO + t64 * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :],
            out,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(PL + t64 * stride_plt + head * stride_plh + split, lse2, mask=row_ok)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial stores precede the (release) arrival
            arrived = tl.atomic_add(COUNTERS + b * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
            if arrived == active - 1:  # the last split of (b, kvh): merge, then re-arm the counter
                tl.atomic_xchg(COUNTERS + b * tl.num_programs(1) + kvh, 0, sem="relaxed", scope="gpu")
                _merge_group(
                    O,
                    LSE,
                    PO,
                    PL,
                    t64,
                    kvh,
                    has_q,
                    active,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    stride_lh,
                    stride_pt,
                    stride_ph,
                    stride_ps,
                    stride_plt,
                    stride_plh,
                    GROUP,
                    HEAD_DIM,
                    BLOCK_D,
                    MERGE_S,
                    MERGE_CHUNK,
                    STORE_LSE,
                    SINKS,
                    HAS_SINKS,
                )


@triton.jit
def _merge_group(
    O,
    LSE,
    PO,
    PL,
    t64,
    kvh,
    has_q,
    num_splits,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_plt,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_S: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    STORE_LSE: tl.constexpr,
    SINKS,
    HAS_SINKS: tl.constexpr,
):
    """Merge the ``num_splits`` partials of the ``GROUP`` heads of ``kvh`` (token ``t64``) into O / LSE
    (``HAS_SINKS``: and each head's sink, one more term with no value row). Partials were written by
    other programs of this launch: loads bypass L1 (``.cg``)."""
    GP: tl.constexpr = pow2_at_least(GROUP)
    g = tl.arange(0, GP)
    g_ok = g < tl.where(has_q, GROUP, 0)
    head = kvh * GROUP + g
    sp = tl.arange(0, MERGE_S)
    lse = tl.load(
        PL + t64 * stride_plt + head[:, None] * stride_plh + sp[None, :],
        mask=g_ok[:, None] & (sp[None, :] < num_splits),
        other=float("-inf"),
        cache_modifier=".cg",
    )
    m = tl.max(lse, 1)
    if HAS_SINKS:
        sink2 = tl.load(SINKS + head, mask=g_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp2(lse - m_safe[:, None]), 1)
    if HAS_SINKS:
        tot += tl.exp2(sink2 - m_safe)
    inv = 1.0 / tl.where(tot > 0.0, tot, 1.0)
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, MERGE_CHUNK)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    for s0 in tl.range(0, num_splits, MERGE_CHUNK, num_stages=2):
        s = s0 + c
        s_ok = s < num_splits
        lc = tl.load(
            PL + t64 * stride_plt + head[:, None] * stride_plh + s[None, :],
            mask=g_ok[:, None] & s_ok[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )  # [GP, C]
        w = tl.exp2(lc - m_safe[:, None]) * inv[:, None]
        p = tl.load(
            PO + t64 * stride_pt + head[:, None, None] * stride_ph + s[None, :, None] * stride_ps + d[None, None, :],
            mask=g_ok[:, None, None] & s_ok[None, :, None] & (d[None, None, :] < HEAD_DIM),
            other=0.0,
            cache_modifier=".cg",
        )  # [GP, C, D]
        acc += tl.sum(p * w[:, :, None], 1)
    tl.store(
        O + t64 * stride_ot + head[:, None] * stride_oh + d[None, :],
        acc.to(O.dtype.element_ty),
        mask=g_ok[:, None] & (d[None, :] < HEAD_DIM),
    )
    if STORE_LSE:
        res = tl.where(tot > 0.0, (m_safe + tl.log2(tl.where(tot > 0.0, tot, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + t64 * stride_lt + head * stride_lh, res, mask=g_ok)
