"""Triton helpers shared by the attention kernels (:mod:`.attention`, :mod:`.prefill`, :mod:`.decode`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """Elementwise tanh through ``sigmoid`` (the soft cap's ``cap * tanh(s / cap)``)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def kv_offsets(kv_indices, page_base, n0, kvh, stride_p, stride_t, stride_h, hi,
               BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
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
