"""Scatter new tokens' K/V into the paged cache: one Triton launch for both caches.

The engines' own backends write the cache with one fused kernel per layer (vLLM's
``reshape_and_cache_flash``); a chain of torch index ops costs ~14 launches per layer instead, which
inside a decode CUDA graph of a 32-layer model measured 0.79-0.89 ms per step on the H200 against
0.053-0.058 ms for this kernel (benchmarks/kv_write_bench.py, benchmarks/NOTES.md). This kernel does no host sync and allocates nothing, so it can be captured;
padding tokens (``slot < 0``) are skipped by a mask, not by a data-dependent shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    K, V, KC, VC, SLOT, page_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(T,)``: token ``t`` -> slot ``SLOT[t]`` (``page * page_size + offset``; < 0: skip)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    page = slot // page_size
    off = slot % page_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # padding skips every head through the bound, not `& keep`: a block mask combined with a scalar
    # bool becomes int32 under the Triton 3.9 interpreter, which refuses it as a load/store mask
    m = (h < tl.where(keep, NUM_HEADS, 0)) & (d < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=m)
    tl.store(KC + page * stride_kcp + off * stride_kco + h * stride_kch + d, k.to(KC.dtype.element_ty), mask=m)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=m)
    tl.store(VC + page * stride_vcp + off * stride_vco + h * stride_vch + d, v.to(VC.dtype.element_ty), mask=m)


def write_kv_paged(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k_cache[slot // P, slot % P] = k[t]`` (same for ``v``) for every ``t`` with ``slot >= 0``.

    Args:
        k, v: ``[>= T, H_kv, D]`` new keys / values (rows past ``T`` are ignored); head dim contiguous.
        k_cache, v_cache: NHD ``[num_pages, P, H_kv, D]`` (any page / token / head strides, head dim
            contiguous; e.g. the two halves of vLLM's ``[2, num_pages, P, H_kv, D]`` cache).
        slot_mapping: ``[T]`` int32 / int64; negative = padding, skipped.

    Capture-safe: one launch, no host sync, no allocation. Slots must be in range (not checked: a
    check would sync; the planners and engines produce them).
    """
    T = slot_mapping.shape[0]
    if T == 0:
        return
    _, P, H, D = k_cache.shape
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head dim (stride 1), got strides {x.stride()}")
    write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, P,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
