"""Triton paged attention: one kernel family for decode, extend/prefill, custom-mask verify.

Design (after the Triton fused-attention tutorial and vLLM's unified attention):

* A *tile* is ``BLOCK_Q`` consecutive query tokens of one request. A program handles one tile and
  one KV head, with the ``GROUP = Hq // Hkv`` query heads of that KV head packed into the rows of
  its ``[BLOCK_M, D]`` query block (row ``r`` = token ``r // GROUP``, head ``r % GROUP``): K/V pages
  are read once per group (GQA head packing), and decode (``BLOCK_Q = 1``) still feeds tensor cores.
* K/V are gathered token by token through the page table (``kv_indices``), so any page size
  1..256 and both NHD and HND layouts work (layout only changes the strides).
* Split-KV: grid axis 2 cuts a tile's visible KV range into ``num_splits`` chunks; each writes a
  partial output and its base-2 LSE, merged by :mod:`.merge`. Without splits the kernel writes the
  final output directly.
* Masks: causal (bottom-right aligned), sliding window, or an arbitrary per-request custom mask
  (row-major ``[q_len, kv_len]`` bytes at ``mask_indptr[b]``); logits soft-cap ``cap*tanh(s/cap)``.
  Blocks that every row of a tile sees whole (below the causal diagonal; before ``mask_free[b]``,
  the custom mask's leading all-visible columns, e.g. a verify tree's prefix) skip all mask work.

Softmax runs in base 2 on fp32 logits; P is cast to the KV dtype for the PV product.

fp8 KV (``KV_FP8``): K/V blocks are loaded as fp8 and converted to q's dtype (exact: every e4m3 /
e5m2 value is a bf16 / fp16 value), so both products are the usual 16-bit tensor-core dots; the
per-layer scales (one-element float32 tensors ``K_SCALE`` / ``V_SCALE``, read on the device) are
folded in exactly: ``k_scale`` into the softmax scale, ``v_scale`` into the final normalization.
``FP8_F16`` (a tile-table choice, every kernel): the dots run in fp16 instead, on
``q * softmax_scale`` rounded to fp16 (10 mantissa bits, finite for ``|q| < 65504 / scale``, 7.4e5 at
head dim 128) and P in fp16: fp8 -> fp16 is one hardware conversion per two values. Under the
Triton interpreter (CPU), whose ``tl.dot`` mishandles 16-bit floats, operands are upcast to fp32
after the same roundings (``UPCAST``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import softmax_step, tanh, tile_request
from .pdl import gdc_launch_dependents

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def sink_state(SINKS, head, l_i):
    """The online softmax state ``(m, l)`` of the sink alone: ``m = sink * log2(e)`` (base 2), ``l = 1``;
    a row's keys then join it as usual (``SINKS [Hq]``, ``head [BLOCK_M]``)."""
    return tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634, l_i + 1.0


@triton.jit
def _attend_block(
    q,
    K,
    V,
    kv_indices,
    page_base,
    kvh,
    n0,
    hi,
    m_i,
    l_i,
    acc,
    row_ok,
    pos,
    mask_row,
    d,
    d_ok,
    sm_scale,
    soft_cap,
    window_left,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One ``BLOCK_N`` block of keys ``[n0, n0+BLOCK_N)`` (clipped to ``hi``) into the online softmax."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    page = tl.load(kv_indices + page_base + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_page = n % PAGE_SIZE
    k_off = page * stride_kp + in_page * stride_kt + kvh * stride_kh
    k = tl.load(K + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    if KV_FP8:  # dequantize: the scale is in sm_scale
        k = k.to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if SOFT_CAP:
        s = soft_cap * tanh(s * (sm_scale / soft_cap)) * 1.4426950408889634
    else:
        s = s * (sm_scale * 1.4426950408889634)
    ok = row_ok[:, None] & n_ok[None, :]
    if CAUSAL:
        ok = ok & (n[None, :] <= pos[:, None])
    if WINDOW:
        ok = ok & (n[None, :] >= pos[:, None] - window_left)
    if HAS_MASK:
        mv = tl.load(mask_row[:, None] + n[None, :], mask=ok, other=0)
        ok = ok & (mv != 0)
    s = tl.where(ok, s, float("-inf"))
    m_new, p, alpha, l_i = softmax_step(s, m_i, l_i)
    v_off = page * stride_vp + in_page * stride_vt + kvh * stride_vh
    v = tl.load(V + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_FP8:  # dequantize: the scale is applied to the output
        v = v.to(q.dtype)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def paged_attention_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    tile_req,
    tile_qstart,
    mask,
    mask_indptr,
    mask_free,
    kv_start,
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
    stride_os,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_F16: tl.constexpr = False,
    PDL: tl.constexpr = False,
    SINKS=None,
    HAS_SINKS: tl.constexpr = False,
):
    """Grid ``(num_tiles, Hkv, num_splits)``.

    Q ``[T, Hq, D]``; K/V paged caches (strides given); O ``[T, Hq, D]`` (or fp32 partials
    ``[T, Hq, S, D]`` when SPLIT); LSE ``[T, Hq]`` natural log (or base-2 partials ``[T, Hq, S]``).
    ``KV_FP8``: K/V hold ``value / scale`` in fp8; ``K_SCALE`` / ``V_SCALE`` one-element float32.
    ``PDL``: a programmatic dependent launched after this kernel (:mod:`.pdl`) may start at once.
    ``HAS_SINKS``: ``SINKS [Hq]`` sink logits join each row's softmax (unsplit launches; split partials
    carry none: :func:`.merge.merge_splits` adds it once).
    """
    if PDL:
        gdc_launch_dependents()
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    b, q0, q_start, q_len, kv_len, page_base = tile_request(tile_req, tile_qstart, qo_indptr, kv_lens, kv_indptr, tile)

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = kv_len - q_len + tok  # absolute position of each query row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    # visible KV range of this tile: [lo, hi)
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(kv_len, kv_len - q_len + tl.minimum(q0 + BLOCK_Q, q_len))
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, kv_len - q_len + q0 - window_left)
    if HAS_KV_START:  # attend only to keys >= kv_start[b] (fa3's tree part: the draft keys)
        lo = tl.maximum(lo, tl.load(kv_start + b))
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    # a program without keys (an empty split, an empty cascade prefix part) reads no query; the range
    # test as a vector (a scalar bool `&` a vector mask is int32 under triton 3.9's interpreter)
    q_ok = row_ok & (rows * 0 + hi > lo)
    q_ptrs = Q + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_FP8:  # logits s = q . (k8 * k_scale) = (q . k8) * k_scale; out = (P @ v8) * v_scale (below)
        if FP8_F16:  # fp16 dots: the softmax scale moves into q (see the module docstring)
            q = (q.to(tl.float32) * sm_scale).to(tl.float16)
            sm_scale = tl.load(K_SCALE)
        else:
            sm_scale = sm_scale * tl.load(K_SCALE)
    if UPCAST:  # the Triton interpreter cannot dot 16-bit floats: compute in fp32 there
        q = q.to(tl.float32)

    mask_row = mask
    if HAS_MASK:
        mask_row = mask + tl.load(mask_indptr + b) + tok.to(tl.int64) * kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS and not SPLIT:  # the sink: one more (base-2) logit, weight 1 at its own max, no value row
        m_i, l_i = sink_state(SINKS, head, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: whole blocks that every row of the tile sees entirely -> no mask work at all.
    free_hi = hi
    if CAUSAL:
        free_hi = tl.minimum(hi, kv_len - q_len + q0 + 1)
    if HAS_MASK:
        free_hi = tl.minimum(hi, tl.load(mask_free + b))
    if WINDOW:
        free_hi = lo  # window edges vary per row: mask everything
    free_hi = tl.maximum(lo, lo + (free_hi - lo) // BLOCK_N * BLOCK_N)
    for n0 in range(lo, free_hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q,
            K,
            V,
            kv_indices,
            page_base,
            kvh,
            n0,
            hi,
            m_i,
            l_i,
            acc,
            row_ok,
            pos,
            mask_row,
            d,
            d_ok,
            sm_scale,
            soft_cap,
            window_left,
            stride_kp,
            stride_kt,
            stride_kh,
            stride_vp,
            stride_vt,
            stride_vh,
            BLOCK_N,
            PAGE_SIZE,
            False,
            False,
            False,
            SOFT_CAP,
            DOT_PRECISION,
            UPCAST,
            KV_FP8,
        )
    # Phase 2: the rest (diagonal blocks, masked columns, window, the ragged end).
    for n0 in range(free_hi, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q,
            K,
            V,
            kv_indices,
            page_base,
            kvh,
            n0,
            hi,
            m_i,
            l_i,
            acc,
            row_ok,
            pos,
            mask_row,
            d,
            d_ok,
            sm_scale,
            soft_cap,
            window_left,
            stride_kp,
            stride_kt,
            stride_kh,
            stride_vp,
            stride_vt,
            stride_vh,
            BLOCK_N,
            PAGE_SIZE,
            CAUSAL,
            HAS_MASK,
            WINDOW,
            SOFT_CAP,
            DOT_PRECISION,
            UPCAST,
            KV_FP8,
        )

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(V_SCALE)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    t_glob = (q_start + tok).to(tl.int64)
    o_ptrs = O + t_glob[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        o_ptrs += split * stride_os  # a row with no key in this split: only its LSE (-inf; merges skip it)
        tl.store(o_ptrs, out, mask=(row_ok & has)[:, None] & d_ok[None, :])
        tl.store(LSE + t_glob * stride_lt + head * stride_lh + split, lse2, mask=row_ok)
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            tl.store(LSE + t_glob * stride_lt + head * stride_lh, lse2 * 0.6931471805599453, mask=row_ok)
