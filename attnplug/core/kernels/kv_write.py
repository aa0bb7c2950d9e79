"""Scatter new tokens' K/V into the paged cache: one Triton launch for both caches.

The engines' own backends write the cache with one fused kernel per layer (vLLM's
``reshape_and_cache_flash``); a chain of torch index ops costs ~14 launches per layer instead
(``docs/measured-choices.md`` has the two measured). This kernel does no host sync and allocates
nothing, so it can be captured; padding tokens (``slot < 0``) are skipped by a mask, not by a data-dependent shape.

fp8 caches: ``x / scale`` in float32, clamped to the largest finite fp8 value (NaN stays NaN), then
rounded to nearest even - vLLM's ``reshape_and_cache_flash`` with ``__NV_SATFINITE``, bit-equal to
``attnplug.core.kv_layout.quantize_fp8``. The rounding is done here in float32 bits
(:func:`fp8_round`) and the cast only sees exact fp8 values: the Triton interpreter's own
float32 -> e5m2 cast drops the carry of a rounding into the exponent (124.5 -> 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def fp8_constants(dtype: torch.dtype) -> dict:
    """Constexprs of :func:`quantize_to_fp8` for ``dtype``: ``FP8_MAX`` (largest finite value),
    ``MANT`` (mantissa bits), ``MIN_NORMAL`` and ``SUB_MAGIC`` (``1.5 * 2**23`` subnormal spacings:
    adding and subtracting it rounds to the subnormal grid, to nearest even)."""
    if dtype == torch.float8_e4m3fn:
        return dict(FP8_MAX=448.0, MANT=3, MIN_NORMAL=2.0**-6, SUB_MAGIC=1.5 * 2.0**-9 * 2.0**23)
    if dtype == torch.float8_e5m2:
        return dict(FP8_MAX=57344.0, MANT=2, MIN_NORMAL=2.0**-14, SUB_MAGIC=1.5 * 2.0**-16 * 2.0**23)
    raise ValueError(f"not an fp8 dtype: {dtype}")


@triton.jit
def fp8_round(x, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr):
    """float32 ``x`` (within the fp8 range) rounded to the fp8 grid, nearest even, still float32."""
    DROP: tl.constexpr = 23 - MANT
    HALF: tl.constexpr = (1 << (DROP - 1)) - 1
    raw = x.to(tl.int32, bitcast=True)
    bits = ((raw + HALF + ((raw >> DROP) & 1)) >> DROP) << DROP  # a carry moves into the exponent
    normal = bits.to(tl.float32, bitcast=True)
    a = tl.abs(x)
    sub = (a + SUB_MAGIC) - SUB_MAGIC  # fixed spacing below MIN_NORMAL
    # x's sign bit onto the (non-negative) subnormal: -0.0 stays -0.0 as in torch's cast (`-sub` would be
    # `0 - sub`, +0.0 for a zero)
    sub = (sub.to(tl.int32, bitcast=True) | ((raw >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(a < MIN_NORMAL, sub, normal)


@triton.jit
def quantize_to_fp8(
    x, scale, FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr
):
    """``x / scale`` (float32) saturated to ``[-FP8_MAX, FP8_MAX]`` (NaN kept) and rounded to the fp8 grid."""
    y = x.to(tl.float32) / scale
    y = tl.minimum(
        tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL
    )
    return fp8_round(y, MANT, MIN_NORMAL, SUB_MAGIC)


@triton.jit
def write_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOT,
    page_size,
    K_SCALE,
    V_SCALE,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kco,
    stride_kch,
    stride_vcp,
    stride_vco,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
):
    """Grid ``(T,)``: token ``t`` -> slot ``SLOT[t]`` (``page * page_size + offset``; < 0: skip).
    ``FP8``: quantize with the one-element float32 scales ``K_SCALE`` / ``V_SCALE``."""
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
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=m)
    if FP8:
        k = quantize_to_fp8(k, tl.load(K_SCALE), FP8_MAX, MANT, MIN_NORMAL, SUB_MAGIC)
        v = quantize_to_fp8(v, tl.load(V_SCALE), FP8_MAX, MANT, MIN_NORMAL, SUB_MAGIC)
    tl.store(KC + page * stride_kcp + off * stride_kco + h * stride_kch + d, k.to(KC.dtype.element_ty), mask=m)
    tl.store(VC + page * stride_vcp + off * stride_vco + h * stride_vch + d, v.to(VC.dtype.element_ty), mask=m)


@triton.jit
def quantize_rows_kernel(
    X,
    Y,
    DQ,
    SCALE,
    T,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    stride_dt,
    stride_dh,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    WRITE_DQ: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_T), H)``: ``Y[t, h] = fp8(X[t, h] / SCALE)`` for ``BLOCK_T`` rows of one
    head a program, saturated (as the KV write); ``WRITE_DQ``: also ``DQ[t, h] = Y[t, h] * SCALE`` in
    DQ's dtype (the value the fp8 kernels compute with)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (t < T) & (d < HEAD_DIM)
    x = tl.load(X + t * stride_xt + h * stride_xh + d, mask=m)
    scale = tl.load(SCALE)
    y = quantize_to_fp8(x, scale, FP8_MAX, MANT, MIN_NORMAL, SUB_MAGIC)
    tl.store(Y + t * stride_yt + h * stride_yh + d, y.to(Y.dtype.element_ty), mask=m)
    if WRITE_DQ:
        tl.store(DQ + t * stride_dt + h * stride_dh + d, (y * scale).to(DQ.dtype.element_ty), mask=m)


def quantize_fp8_rows(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, dequant_out: torch.Tensor | None = None
) -> torch.Tensor:
    """``out [T, H, D]`` (fp8) = ``x [T, H, D] / scale`` saturated and rounded like the fp8 KV write
    (vLLM's static per-tensor ``QuantFP8`` of the query); ``scale`` a one-element float32 device
    tensor. ``dequant_out [T, H, D]`` (optional, any float dtype): ``out * scale``, the query an fp8
    kernel computes with, written by the same launch. One launch, no sync, no allocation: capturable.
    Head dims contiguous."""
    dq = out if dequant_out is None else dequant_out
    if x.stride(-1) != 1 or out.stride(-1) != 1 or dq.stride(-1) != 1:
        raise ValueError(
            f"x, out and dequant_out must have a contiguous last dim, got strides {x.stride()} / "
            f"{out.stride()} / {dq.stride()}"
        )
    T, H, D = x.shape
    if T:
        block_t = min(32, triton.next_power_of_2(T))  # decode: one row; prefill: 32 rows x D a program
        quantize_rows_kernel[(triton.cdiv(T, block_t), H)](
            x,
            out,
            dq,
            scale,
            T,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            dq.stride(0),
            dq.stride(1),
            HEAD_DIM=D,
            BLOCK_T=block_t,
            BLOCK_D=triton.next_power_of_2(D),
            WRITE_DQ=dequant_out is not None,
            **fp8_constants(out.dtype),
        )
    return out


def write_kv_paged(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``k_cache[slot // P, slot % P] = k[t]`` (same for ``v``) for every ``t`` with ``slot >= 0``.

    fp8 caches (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, both the same dtype) store
    ``k[t] / k_scale`` saturated and rounded (see the module docstring); ``k_scale`` / ``v_scale``
    are one-element float32 tensors on the device (read by the kernel: in-place updates apply,
    CUDA graphs capture the pointer), required for fp8 and unused otherwise.

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
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8 and (v_cache.dtype != k_cache.dtype or k_scale is None or v_scale is None):
        raise ValueError(
            "attnplug: an fp8 KV write needs k_cache and v_cache of one fp8 dtype and k_scale / "
            f"v_scale tensors; got {k_cache.dtype} / {v_cache.dtype}, scales {k_scale is not None} / "
            f"{v_scale is not None}"
        )
    consts = fp8_constants(k_cache.dtype) if fp8 else dict(FP8_MAX=0.0, MANT=0, MIN_NORMAL=0.0, SUB_MAGIC=0.0)
    write_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        P,
        k_scale if fp8 else slot_mapping,
        v_scale if fp8 else slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=H,
        HEAD_DIM=D,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_D=triton.next_power_of_2(D),
        FP8=fp8,
        **consts,
    )
