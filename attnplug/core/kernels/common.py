"""Triton helpers shared by the attention kernels (:mod:`.attention`, :mod:`.prefill`, :mod:`.decode`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """Elementwise tanh through ``sigmoid`` (the soft cap's ``cap * tanh(s / cap)``)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax step over masked base-2 scores ``s [M, N]`` (``-inf`` = hidden): the new row max
    ``m_new [M]``, the weights ``p [M, N]``, the rescale ``alpha [M]`` of the old state and the new row sums
    ``l_i [M]`` (rows with no key so far stay at max ``-inf``, sum 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, 1)


@triton.jit
def tile_request(tile_req, tile_qstart, qo_indptr, kv_lens, kv_indptr, tile):
    """A tile's request ``b``, its first query token ``q0`` (within the request), the request's first
    query row ``q_start``, ``q_len``, ``kv_len`` and first page slot ``page_base`` (in ``kv_indices``)."""
    b = tl.load(tile_req + tile)
    q0 = tl.load(tile_qstart + tile)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    return b, q0, q_start, q_len, tl.load(kv_lens + b), tl.load(kv_indptr + b)


@triton.jit
def kv_offsets(
    kv_indices,
    page_base,
    n0,
    kvh,
    stride_p,
    stride_t,
    stride_h,
    hi,
    BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Row offsets ``[BLOCK]`` (int64) of keys ``n0 .. n0+BLOCK`` of KV head ``kvh`` and their
    validity ``n < hi``. One page id per key: the ids of a block are one small contiguous load, which
    the pipeliner copies asynchronously ahead of the rows (one id per page, reshaped to rows, kept
    Triton 3.6 from pipelining the row loads)."""
    n = n0 + tl.arange(0, BLOCK)
    ok = n < hi
    if MASKED:
        page = tl.load(kv_indices + page_base + n // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    else:
        page = tl.load(kv_indices + page_base + n // PAGE_SIZE).to(tl.int64)
    return page * stride_p + (n % PAGE_SIZE) * stride_t + kvh * stride_h, ok
