"""Triton causal prefill / extend over a paged KV cache: the Hopper path of the triton provider.

Used for long-query batches without a custom mask, window, soft cap or KV splits (the provider's
``_prefill_kernel_ok``), and, ``NONCAUSAL`` with split-KV, for the cascade's shared-prefix parts when the
``noncausal`` tile entry names this kernel; everything else runs :mod:`.attention`. Same tile list and GQA packing as
:mod:`.attention` (a program = ``BLOCK_Q`` query tokens x the ``GROUP`` heads of one KV head, rows
``r`` = token ``r // GROUP``, head ``r % GROUP``), so the provider's plans and CUDA-graph buffers are
shared; what differs is the inner loop, written for wgmma-sized tiles (``BLOCK_M`` 128, 8 warps):

* **Schedule**: program ``p`` of axis 0 takes tile ``num_tiles - 1 - p`` of a list the provider sorts
  by causal work (keys a tile sees), ascending: the longest tiles of the whole batch launch first
  and the last wave is made of short ones (the hardware hands out programs in order as SMs free up:
  a dynamic longest-first schedule over (request, head group, q tile), no persistent loop needed).
  Axis 1 is the KV head, so the programs running together share their requests' K/V in L2.
* **Causal block skipping**: keys ``[0, free_hi)`` that every row of the tile sees are streamed in
  ``BLOCK_N`` blocks with no mask work at all (no compare, no select, no load masks); the diagonal
  keys ``[free_hi, hi)`` (at most ``BLOCK_Q + BLOCK_N - 1`` of them) run a second, masked loop with
  ``DIAG_N``-key blocks, so little of the masked triangle is computed and thrown away. ``DIAG_N`` 0:
  one loop over every block instead, the causal select behind a scalar branch taken only on the
  diagonal blocks (loads masked by ``hi`` throughout): the diagonal's loads are then prefetched like
  the others instead of stalling the 1-2 iterations of a loop of their own.
* **Loads**: K/V of a block are gathered through the page table, one page id per key (the ids of a
  block: one small contiguous load); ``PAGE_TMA`` (the page size a multiple of ``BLOCK_N``, the host
  passes 4-D tensor descriptors): a block is one ``[BLOCK_N, D]`` tile of one page, one page id per
  block, loaded by the Hopper copy engine (TMA). Loads sit in a ``tl.range`` with ``NUM_STAGES``:
  Triton's pipeliner turns them into asynchronous copies; the page-id load and the row load form a
  chain, so the rows run ``(NUM_STAGES - 1) // 2`` blocks ahead (5 stages: 2 blocks in flight while
  one computes; 3 stages hide only the PV product: read off sm90 SASS compiled with Triton 3.6).
* Softmax in base 2 on fp32 logits with the scale folded into one FMA (``s * scale - m``); masked
  logits are ``-inf`` in the diagonal loop only. P is cast to the value dtype for the PV product.

fp8 KV (``KV_FP8``, ``FP8_F16``) as in :mod:`.attention`: K/V blocks are loaded as fp8 and converted to q's dtype;
``K_SCALE`` folds into the softmax scale, ``V_SCALE`` into the final normalization. ``UPCAST``: the
CPU interpreter's ``tl.dot`` needs fp32 operands.

Not used (Triton 3.6 on sm90, checked by compiling and reading the SASS): ``tl.range(...,
warp_specialize=True)`` compiles to the very same SASS, pointer or TMA loads alike (the Hopper pass
of open-source Triton leaves this loop alone; triton-lang/triton#9728 for its TMA-only scope);
issuing the next block's ``Q K^T`` before this block's softmax (a loop-carried score tile) makes
Triton wait on every wgmma k-step instead of overlapping; one page id per page reshaped into rows
kept the row loads out of the pipeline (synchronous loads, spills at ``BLOCK_N`` 128).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import sink_state
from .common import kv_offsets, tanh, tile_request
from .pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_k(
    K,
    K_desc,
    kv_indices,
    page_base,
    n0,
    kvh,
    stride_p,
    stride_t,
    stride_h,
    hi,
    d,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K of keys ``n0 .. n0+BLOCK`` as ``[BLOCK_D, BLOCK]`` (transposed for ``q @ k``)."""
    if PAGE_TMA:  # the block lies in one page: one 2-D copy of [BLOCK, D] (rows past hi: masked later)
        page = tl.load(kv_indices + page_base + n0 // PAGE_SIZE)
        k = K_desc.load([page, n0 % PAGE_SIZE, kvh, 0]).reshape(BLOCK, d.shape[0]).T
    else:
        off, ok = kv_offsets(kv_indices, page_base, n0, kvh, stride_p, stride_t, stride_h, hi, BLOCK, PAGE_SIZE, MASKED)
        if MASKED:
            k = tl.load(K + off[None, :] + d[:, None], mask=ok[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
        elif HEAD_DIM == d.shape[0]:
            k = tl.load(K + off[None, :] + d[:, None])
        else:
            k = tl.load(K + off[None, :] + d[:, None], mask=(d[:, None] < HEAD_DIM), other=0.0)
    return k


@triton.jit
def _load_v(
    V,
    V_desc,
    kv_indices,
    page_base,
    n0,
    kvh,
    stride_p,
    stride_t,
    stride_h,
    hi,
    d,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """V of keys ``n0 .. n0+BLOCK`` as ``[BLOCK, BLOCK_D]`` (rows past ``hi`` are zero)."""
    if PAGE_TMA:
        page = tl.load(kv_indices + page_base + n0 // PAGE_SIZE)
        v = V_desc.load([page, n0 % PAGE_SIZE, kvh, 0]).reshape(BLOCK, d.shape[0])
        if MASKED:  # rows past hi may be another request's keys (or garbage): P is 0 there, V must be finite
            n = n0 + tl.arange(0, BLOCK)
            v = tl.where((n < hi)[:, None], v, tl.zeros_like(v))
    else:
        off, ok = kv_offsets(kv_indices, page_base, n0, kvh, stride_p, stride_t, stride_h, hi, BLOCK, PAGE_SIZE, MASKED)
        if MASKED:
            v = tl.load(V + off[:, None] + d[None, :], mask=ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        elif HEAD_DIM == d.shape[0]:
            v = tl.load(V + off[:, None] + d[None, :])
        else:
            v = tl.load(V + off[:, None] + d[None, :], mask=(d[None, :] < HEAD_DIM), other=0.0)
    return v


@triton.jit
def block_softmax(
    q,
    K,
    K_desc,
    kv_indices,
    page_base,
    n0,
    kvh,
    hi,
    pos,
    d,
    m_i,
    l_i,
    qk_scale,
    soft_cap,
    stride_kp,
    stride_kt,
    stride_kh,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    P_DTYPE: tl.constexpr,
    diag_from=0,
    MASK_FROM: tl.constexpr = False,
):
    """The logits of keys ``n0 .. n0+BLOCK`` (KV head ``kvh``) into the online softmax: ``(m_new, l_new,
    p [BLOCK_M, BLOCK] fp32, alpha [BLOCK_M])``; the caller adds ``p @ V`` to ``acc * alpha``.

    ``qk_scale``: softmax scale times log2(e) (``SOFT_CAP``: the plain softmax scale; logits become
    ``cap * tanh(s * scale / cap)``). Not ``MASKED``: every key is visible and below ``hi``, no mask
    work. ``MASKED``: keys with ``n > pos[row]`` (``CAUSAL``, the diagonal) or ``n >= hi`` (else: the
    ragged end of a split) are hidden. ``MASK_FROM`` (prefill, one loop over all blocks): loads masked
    by ``hi``, the causal mask applied only when ``n0 >= diag_from`` (a branch on a scalar: blocks below
    the diagonal skip it)."""
    LOAD_MASK: tl.constexpr = MASKED or MASK_FROM
    k = _load_k(
        K,
        K_desc,
        kv_indices,
        page_base,
        n0,
        kvh,
        stride_kp,
        stride_kt,
        stride_kh,
        hi,
        d,
        BLOCK,
        HEAD_DIM,
        PAGE_SIZE,
        PAGE_TMA,
        LOAD_MASK,
    )
    if KV_FP8:  # dequantize: the scale is in qk_scale
        k = k.to(P_DTYPE)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    return softmax_update(
        s, n0, hi, pos, m_i, l_i, qk_scale, soft_cap, BLOCK, MASKED, CAUSAL, SOFT_CAP, diag_from, MASK_FROM
    )


@triton.jit
def softmax_update(
    s,
    n0,
    hi,
    pos,
    m_i,
    l_i,
    qk_scale,
    soft_cap,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    diag_from=0,
    MASK_FROM: tl.constexpr = False,
):
    """The online softmax step of :func:`block_softmax` on raw logits ``s`` ``[BLOCK_M, BLOCK]`` (``q . k``,
    unscaled): ``(m_new, l_new, p, alpha)``."""
    if SOFT_CAP:
        s = soft_cap * tanh(s * (qk_scale / soft_cap)) * 1.4426950408889634
    if MASKED:
        n = n0 + tl.arange(0, BLOCK)
        if not SOFT_CAP:
            s = s * qk_scale
        if CAUSAL:
            s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        else:
            s = tl.where((n < hi)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    elif SOFT_CAP:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:  # the scale folded into one FMA
        if MASK_FROM:
            if n0 >= diag_from:  # a diagonal block: -inf stays -inf through the scale
                n = n0 + tl.arange(0, BLOCK)
                s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, p, alpha


@triton.jit
def attend_block(
    q,
    K,
    V,
    K_desc,
    V_desc,
    kv_indices,
    page_base,
    n0,
    kvh,
    hi,
    pos,
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
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    P_DTYPE: tl.constexpr,
    diag_from=0,
    MASK_FROM: tl.constexpr = False,
):
    """Keys ``n0 .. n0+BLOCK`` of KV head ``kvh`` into the online softmax ``(m_i, l_i, acc)`` (base 2):
    :func:`block_softmax`, then ``acc * alpha + p @ V``. Shared by the prefill and decode kernels."""
    m_new, l_i, p, alpha = block_softmax(
        q,
        K,
        K_desc,
        kv_indices,
        page_base,
        n0,
        kvh,
        hi,
        pos,
        d,
        m_i,
        l_i,
        qk_scale,
        soft_cap,
        stride_kp,
        stride_kt,
        stride_kh,
        BLOCK,
        HEAD_DIM,
        PAGE_SIZE,
        PAGE_TMA,
        MASKED,
        CAUSAL,
        SOFT_CAP,
        DOT_PRECISION,
        UPCAST,
        KV_FP8,
        P_DTYPE,
        diag_from,
        MASK_FROM,
    )
    LOAD_MASK: tl.constexpr = MASKED or MASK_FROM
    v = _load_v(
        V,
        V_desc,
        kv_indices,
        page_base,
        n0,
        kvh,
        stride_vp,
        stride_vt,
        stride_vh,
        hi,
        d,
        BLOCK,
        HEAD_DIM,
        PAGE_SIZE,
        PAGE_TMA,
        LOAD_MASK,
    )
    if KV_FP8:
        v = v.to(P_DTYPE)
    p = p.to(P_DTYPE)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None]
    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_into_base(
    PO,
    PL,
    BO,
    BL,
    t_glob,
    head,
    row_ok,
    d,
    num_splits,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_bot,
    stride_boh,
    stride_blt,
    stride_blh,
    HEAD_DIM: tl.constexpr,
    FROM_SPLITS: tl.constexpr,
    own_o,
    own_lse2,
):
    """Merge into the base state ``BO [T, Hq, D]`` / ``BL [T, Hq]`` (natural log) of a tile's rows: the
    ``num_splits`` partials ``PO`` / base-2 ``PL`` (``FROM_SPLITS``; loads bypass L1: other programs of
    this launch wrote them), or the state ``own_o`` / base-2 ``own_lse2`` in registers. An empty partial
    is not read; a row with no keys here is not written."""
    d_ok = d[None, :] < HEAD_DIM
    m = tl.load(BL + t_glob * stride_blt + head * stride_blh, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    w = tl.where(m > float("-inf"), 1.0, 0.0)
    acc = tl.load(
        BO + t_glob[:, None] * stride_bot + head[:, None] * stride_boh + d[None, :],
        mask=row_ok[:, None] & d_ok & (m > float("-inf"))[:, None],
        other=0.0,
    ).to(tl.float32)
    mine = m < float("-inf")  # rows this part has keys for (none yet)
    if FROM_SPLITS:
        for s in range(0, num_splits):
            ls = tl.load(
                PL + t_glob * stride_lt + head * stride_lh + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
            )
            p = tl.load(
                PO + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + s * stride_os + d[None, :],
                mask=row_ok[:, None] & d_ok & (ls > float("-inf"))[:, None],
                other=0.0,
                cache_modifier=".cg",
            ).to(tl.float32)
            m, w, acc = _lse_add(m, w, acc, ls, p)
            mine = mine | (ls > float("-inf"))
    else:
        m, w, acc = _lse_add(m, w, acc, own_lse2, tl.where((own_lse2 > float("-inf"))[:, None], own_o, 0.0))
        mine = own_lse2 > float("-inf")
    keep = row_ok & mine
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(
        BO + t_glob[:, None] * stride_bot + head[:, None] * stride_boh + d[None, :],
        (acc / tl.where(w > 0.0, w, 1.0)[:, None]).to(BO.dtype.element_ty),
        mask=keep[:, None] & d_ok,
    )
    tl.store(
        BL + t_glob * stride_blt + head * stride_blh,
        tl.where(w > 0.0, (m_safe + tl.log2(tl.where(w > 0.0, w, 1.0))) * 0.6931471805599453, float("-inf")),
        mask=keep,
    )


@triton.jit
def _lse_add(m, w, acc, ls, p):
    """Online merge of one more state (base-2 LSE ``ls``, value ``p``) into ``(m, w, acc)``: the running
    base-2 maximum, the weight sum and the weighted values, both relative to ``m``."""
    m_new = tl.maximum(m, ls)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    ws = tl.exp2(ls - m_safe)
    return m_new, w * alpha + ws, acc * alpha[:, None] + p * ws[:, None]


@triton.jit
def _prefill_tile(
    tile,
    kvh,
    split,
    Q,
    K,
    V,
    O,
    LSE,
    K_desc,
    V_desc,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    tile_req,
    tile_qstart,
    K_SCALE,
    V_SCALE,
    num_tiles,
    sm_scale,
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
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAG_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TMA: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_F16: tl.constexpr = False,
    NONCAUSAL: tl.constexpr = False,
    num_splits=1,
    stride_os=0,
    PDL: tl.constexpr = False,
    SINKS=None,
    HAS_SINKS: tl.constexpr = False,
    MERGE_BASE: tl.constexpr = False,
    COUNTERS=None,
    BASE_O=None,
    BASE_L=None,
    stride_bot=0,
    stride_boh=0,
    stride_blt=0,
    stride_blh=0,
):
    """One tile of :func:`prefill_kernel` (its arguments, and the tile, KV head and split of this program)."""
    b, q0, q_start, q_len, kv_len, page_base = tile_request(tile_req, tile_qstart, qo_indptr, kv_lens, kv_indptr, tile)
    go = True  # static: a causal launch's body is not wrapped in a branch
    if MERGE_BASE:  # a request without keys (nothing shared at this replay): no work, the suffix state stays
        go = kv_len > 0
    if go:
        rows = tl.arange(0, BLOCK_M)
        tok = q0 + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        pos = kv_len - q_len + tok  # absolute position of each query row
        d = tl.arange(0, BLOCK_D)

        keys_ok = row_ok  # rows whose query is loaded: all valid rows, or none in a split without keys
        if NONCAUSAL:
            chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(kv_len, lo + chunk)
            # a split without keys (an unshared batch in a cascade graph) moves one LSE a row only; compared
            # as a block (triton 3.9's interpreter types a block & a scalar comparison as int32)
            keys_ok = row_ok & (rows * 0 + lo < hi)
        q_ptrs = Q + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=keys_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        if KV_FP8 and FP8_F16:  # fp16 dots on q * sm_scale (see :mod:`.attention`)
            q = (q.to(tl.float32) * sm_scale).to(tl.float16)
            sm_scale = 1.0
        P_DTYPE: tl.constexpr = q.dtype
        if UPCAST:
            q = q.to(tl.float32)
        qk_scale = sm_scale * 1.4426950408889634
        if KV_FP8:
            qk_scale = qk_scale * tl.load(K_SCALE)

        pos0 = kv_len - q_len + q0  # the tile's first row: keys [0, pos0] are visible to every row
        if not NONCAUSAL:
            hi = tl.minimum(kv_len, pos0 + BLOCK_Q)
        free_hi = (pos0 + 1) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink's (base-2) logit with weight 1, no value row (see :func:`.attention.sink_state`)
            m_i, l_i = sink_state(SINKS, head, l_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        if NONCAUSAL:  # every key visible: this split's whole blocks unmasked, then its ragged end masked
            full_hi = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)
            for n0 in tl.range(lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = attend_block(
                    q,
                    K,
                    V,
                    K_desc,
                    V_desc,
                    kv_indices,
                    page_base,
                    n0,
                    kvh,
                    hi,
                    pos,
                    d,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    0.0,
                    stride_kp,
                    stride_kt,
                    stride_kh,
                    stride_vp,
                    stride_vt,
                    stride_vh,
                    BLOCK_N,
                    HEAD_DIM,
                    PAGE_SIZE,
                    PAGE_TMA,
                    False,
                    False,
                    False,
                    DOT_PRECISION,
                    UPCAST,
                    KV_FP8,
                    P_DTYPE,
                )
            if full_hi < hi:
                m_i, l_i, acc = attend_block(
                    q,
                    K,
                    V,
                    K_desc,
                    V_desc,
                    kv_indices,
                    page_base,
                    full_hi,
                    kvh,
                    hi,
                    pos,
                    d,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    0.0,
                    stride_kp,
                    stride_kt,
                    stride_kh,
                    stride_vp,
                    stride_vt,
                    stride_vh,
                    BLOCK_N,
                    HEAD_DIM,
                    PAGE_SIZE,
                    PAGE_TMA,
                    True,
                    False,
                    False,
                    DOT_PRECISION,
                    UPCAST,
                    KV_FP8,
                    P_DTYPE,
                )
        elif DIAG_N == 0:  # one pipelined loop: the diagonal blocks' loads are prefetched like the others
            for n0 in tl.range(0, hi, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = attend_block(
                    q,
                    K,
                    V,
                    K_desc,
                    V_desc,
                    kv_indices,
                    page_base,
                    n0,
                    kvh,
                    hi,
                    pos,
                    d,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    0.0,
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
                    True,
                    False,
                    DOT_PRECISION,
                    UPCAST,
                    KV_FP8,
                    P_DTYPE,
                    free_hi,
                    True,
                )
        else:
            # Phase 1: whole blocks below the diagonal: no mask work.
            for n0 in tl.range(0, free_hi, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = attend_block(
                    q,
                    K,
                    V,
                    K_desc,
                    V_desc,
                    kv_indices,
                    page_base,
                    n0,
                    kvh,
                    hi,
                    pos,
                    d,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    0.0,
                    stride_kp,
                    stride_kt,
                    stride_kh,
                    stride_vp,
                    stride_vt,
                    stride_vh,
                    BLOCK_N,
                    HEAD_DIM,
                    PAGE_SIZE,
                    PAGE_TMA,
                    False,
                    True,
                    False,
                    DOT_PRECISION,
                    UPCAST,
                    KV_FP8,
                    P_DTYPE,
                )
            # Phase 2: the diagonal (and the ragged end of the keys), masked, in DIAG_N-key blocks.
            DIAG_TMA: tl.constexpr = PAGE_TMA and DIAG_N == BLOCK_N
            for n0 in tl.range(free_hi, hi, DIAG_N, num_stages=2):
                m_i, l_i, acc = attend_block(
                    q,
                    K,
                    V,
                    K_desc,
                    V_desc,
                    kv_indices,
                    page_base,
                    n0,
                    kvh,
                    hi,
                    pos,
                    d,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    0.0,
                    stride_kp,
                    stride_kt,
                    stride_kh,
                    stride_vp,
                    stride_vt,
                    stride_vh,
                    DIAG_N,
                    HEAD_DIM,
                    PAGE_SIZE,
                    DIAG_TMA,
                    True,
                    True,
                    False,
                    DOT_PRECISION,
                    UPCAST,
                    KV_FP8,
                    P_DTYPE,
                )

        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if KV_FP8:
            out = out * tl.load(V_SCALE)
        t_glob = (q_start + tok).to(tl.int64)
        if NONCAUSAL:
            lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            if num_splits > 1:  # this split's partial (fp32 or the output dtype; none without keys) and base-2 LSE
                o_ptrs = O + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
                tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=keys_ok[:, None] & (d[None, :] < HEAD_DIM))
                tl.store(LSE + t_glob * stride_lt + head * stride_lh + split, lse2, mask=row_ok)
                if MERGE_BASE:
                    tl.debug_barrier()  # every thread's partial stores precede the (release) arrival
                    cnt = COUNTERS + tile * tl.num_programs(1) + kvh
                    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
                    if arrived == num_splits - 1:  # the last split of (tile, kvh): merge, then re-arm the counter
                        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
                        if PDL:  # the base is the suffix part's output: the kernel before this one
                            gdc_wait()
                        _merge_into_base(
                            O,
                            LSE,
                            BASE_O,
                            BASE_L,
                            t_glob,
                            head,
                            row_ok,
                            d,
                            num_splits,
                            stride_ot,
                            stride_oh,
                            stride_os,
                            stride_lt,
                            stride_lh,
                            stride_bot,
                            stride_boh,
                            stride_blt,
                            stride_blh,
                            HEAD_DIM,
                            True,
                            out,
                            lse2,
                        )
            elif MERGE_BASE:  # unsplit: this program's own state into the base (O / LSE), in registers
                if PDL:
                    gdc_wait()
                _merge_into_base(
                    O,
                    LSE,
                    O,
                    LSE,
                    t_glob,
                    head,
                    row_ok,
                    d,
                    1,
                    0,
                    0,
                    0,
                    0,
                    0,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    stride_lh,
                    HEAD_DIM,
                    False,
                    out,
                    lse2,
                )
            else:
                o_ptrs = O + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))
                if STORE_LSE:
                    tl.store(LSE + t_glob * stride_lt + head * stride_lh, lse2 * 0.6931471805599453, mask=row_ok)
        else:
            o_ptrs = O + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))
            if STORE_LSE:
                lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
                tl.store(LSE + t_glob * stride_lt + head * stride_lh, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def prefill_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    K_desc,
    V_desc,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    tile_req,
    tile_qstart,
    K_SCALE,
    V_SCALE,
    num_tiles,
    sm_scale,
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
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAG_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_TMA: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_F16: tl.constexpr = False,
    NONCAUSAL: tl.constexpr = False,
    num_splits=1,
    stride_os=0,
    PDL: tl.constexpr = False,
    SINKS=None,
    HAS_SINKS: tl.constexpr = False,
    MERGE_BASE: tl.constexpr = False,
    COUNTERS=None,
    BASE_O=None,
    BASE_L=None,
    stride_bot=0,
    stride_boh=0,
    stride_blt=0,
    stride_blh=0,
    TILE_COUNT=None,
    STRIDED: tl.constexpr = False,
):
    """Grid ``(num_tiles, Hkv)``: causal (bottom-right aligned), no split. ``NONCAUSAL`` (the cascade's
    shared-prefix parts): grid ``(num_tiles, Hkv, num_splits)``, every row sees every key; split ``s``
    takes keys ``[s * chunk, (s + 1) * chunk)`` (``chunk`` = the keys over ``num_splits``, rounded up
    to ``BLOCK_N``) in unmasked blocks, then its ragged end masked.

    Q ``[T, Hq, D]``; K/V paged caches (strides given; ``K_desc`` / ``V_desc``: 4-D tensor descriptors
    ``[pages, PAGE_SIZE, Hkv, D]`` with block ``[1, BLOCK_N, 1, D]`` when ``PAGE_TMA``, else unused);
    O ``[T, Hq, D]``; LSE ``[T, Hq]`` natural log (``STORE_LSE``). ``num_splits > 1`` (``NONCAUSAL``
    only): O is the partials ``[T, Hq, S, D]`` (float32 or 16-bit; split stride ``stride_os``) and LSE their base-2
    LSE ``[T, Hq, S]`` (contiguous in S), as :func:`.merge.merge_splits` reads them.

    ``PDL`` (launched with ``launch_pdl=True``, :mod:`.pdl`): reads nothing the kernel before it writes;
    lets the next kernel launch at once and waits for the one before it to complete before exiting.
    ``HAS_SINKS`` (``num_splits == 1`` only; split partials carry no sink, their merge adds it):
    ``SINKS [Hq]`` sink logits join each row's softmax.

    ``MERGE_BASE`` (``NONCAUSAL``, no sinks; the cascade graphs' prefix part): the result merges by LSE
    into the state ``BASE_O [T, Hq, D]`` / ``BASE_L [T, Hq]`` (natural log) the suffix part wrote, in
    this launch: unsplit, each program merges its own rows (``BASE_O`` / ``BASE_L`` are then ``O`` /
    ``LSE``); split, the last split of a ``(tile, KV head)`` to arrive on ``COUNTERS [tiles * Hkv]``
    int32 (zero before and after the launch) merges the partials. A request without keys (a batch
    that shares nothing) returns at once: the whole launch does no work and the base is untouched.

    ``STRIDED`` (with ``MERGE_BASE``; the cascade graphs' prefix part): grid ``(W, Hkv, num_splits)``, program
    ``p`` of axis 0 takes tiles ``p, p + W, ...`` below ``TILE_COUNT [1]`` int32 (the tiles of the groups the
    graph update cut): a replay that cut nothing runs ``W x Hkv x num_splits`` programs that read the count. The
    first tile is straight code, the rest a loop (the loop's hoisted values would otherwise spill in the first
    tile's key loop at 16 warps).
    """
    if PDL:
        gdc_launch_dependents()
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if STRIDED:  # program p takes tiles p, p + W, ... below the TILE_COUNT the graph update wrote
        tile = tl.program_id(0)
        count = tl.load(TILE_COUNT)
        run = tile < count
    else:  # longest causal tiles first (see the module docstring)
        tile = num_tiles - 1 - tl.program_id(0)
        run = True  # static: no branch around the tile
    if run:  # the first tile straight (the common case, one tile a program), the rest in a loop
        _prefill_tile(
            tile,
            kvh,
            split,
            Q,
            K,
            V,
            O,
            LSE,
            K_desc,
            V_desc,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_lens,
            tile_req,
            tile_qstart,
            K_SCALE,
            V_SCALE,
            num_tiles,
            sm_scale,
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
            GROUP,
            BLOCK_Q,
            BLOCK_M,
            BLOCK_N,
            DIAG_N,
            HEAD_DIM,
            BLOCK_D,
            PAGE_SIZE,
            PAGE_TMA,
            NUM_STAGES,
            STORE_LSE,
            DOT_PRECISION,
            UPCAST,
            KV_FP8,
            FP8_F16,
            NONCAUSAL,
            num_splits,
            stride_os,
            PDL,
            SINKS,
            HAS_SINKS,
            MERGE_BASE,
            COUNTERS,
            BASE_O,
            BASE_L,
            stride_bot,
            stride_boh,
            stride_blt,
            stride_blh,
        )
        if STRIDED:
            for t in range(tile + tl.num_programs(0), count, tl.num_programs(0)):
                _prefill_tile(
                    t,
                    kvh,
                    split,
                    Q,
                    K,
                    V,
                    O,
                    LSE,
                    K_desc,
                    V_desc,
                    qo_indptr,
                    kv_indptr,
                    kv_indices,
                    kv_lens,
                    tile_req,
                    tile_qstart,
                    K_SCALE,
                    V_SCALE,
                    num_tiles,
                    sm_scale,
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
                    GROUP,
                    BLOCK_Q,
                    BLOCK_M,
                    BLOCK_N,
                    DIAG_N,
                    HEAD_DIM,
                    BLOCK_D,
                    PAGE_SIZE,
                    PAGE_TMA,
                    NUM_STAGES,
                    STORE_LSE,
                    DOT_PRECISION,
                    UPCAST,
                    KV_FP8,
                    FP8_F16,
                    NONCAUSAL,
                    num_splits,
                    stride_os,
                    PDL,
                    SINKS,
                    HAS_SINKS,
                    MERGE_BASE,
                    COUNTERS,
                    BASE_O,
                    BASE_L,
                    stride_bot,
                    stride_boh,
                    stride_blt,
                    stride_blh,
                )
    if PDL:  # the kernel before this one (the cascade's suffix part) has completed when this one has
        gdc_wait()
