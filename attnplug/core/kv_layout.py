"""Paged KV-cache layouts, allocation and token scatter.

* ``NHD``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (vLLM / FlashInfer default).
* ``HND``: ``[num_pages, num_kv_heads, page_size, head_dim]``.

Slot ``s`` addresses token offset ``s % page_size`` of page ``s // page_size``.

fp8 caches (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) hold ``x / scale`` clamped to the fp8
range, then rounded to nearest even (vLLM's ``reshape_and_cache_flash``: float32 division, saturation
to the largest finite value): :func:`quantize_fp8`; reads multiply by the scale (:func:`dequantize`).
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = [
    "KVLayout",
    "MAX_PAGE_SIZE",
    "kv_cache_shape",
    "to_nhd",
    "from_nhd",
    "allocate_kv_cache",
    "write_kv",
    "quantize_fp8",
    "dequantize",
]

MAX_PAGE_SIZE = 256


class KVLayout(str, Enum):
    """Paged KV-cache layout; compares equal to its string name (``KVLayout.NHD == "NHD"``)."""

    NHD = "NHD"
    HND = "HND"


def _layout(layout: KVLayout | str) -> KVLayout:
    try:
        return KVLayout(layout)
    except ValueError:
        raise ValueError(f"layout must be one of {[m.value for m in KVLayout]}, got {layout!r}") from None


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be an int in 1..{MAX_PAGE_SIZE}, got {page_size!r}")


def kv_cache_shape(
    layout: KVLayout | str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one of the K / V caches in ``layout``."""
    _check_page_size(page_size)
    for name, v in (("num_pages", num_pages), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or v < (0 if name == "num_pages" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'num_pages' else 'positive'} int, got {v!r}")
    if _layout(layout) is KVLayout.NHD:
        return (num_pages, page_size, num_kv_heads, head_dim)
    return (num_pages, num_kv_heads, page_size, head_dim)


def to_nhd(cache: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    """View a 4-D cache in ``layout`` as ``[num_pages, page_size, H_kv, D]`` (no copy; writes go through)."""
    if cache.dim() != 4:
        raise ValueError(f"cache must be 4-D, got shape {list(cache.shape)}")
    return cache if _layout(layout) is KVLayout.NHD else cache.permute(0, 2, 1, 3)


def from_nhd(cache_nhd: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    """Inverse of :func:`to_nhd`: view ``[num_pages, page_size, H_kv, D]`` in ``layout`` (no copy)."""
    return to_nhd(cache_nhd, layout)  # the permutation (0, 2, 1, 3) is its own inverse


def allocate_kv_cache(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    layout: KVLayout | str = KVLayout.NHD,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-filled ``(k_cache, v_cache)``, each of :func:`kv_cache_shape` in ``dtype`` on ``device``."""
    shape = kv_cache_shape(layout, num_pages, page_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` (float32) clamped to ``dtype``'s finite range, then cast (round to nearest even):
    the engines' fp8 KV quantization with saturation. ``scale``: a float or a one-element tensor."""
    if not _is_fp8(dtype):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    big = torch.finfo(dtype).max
    s = scale.reshape(()).float() if isinstance(scale, torch.Tensor) else float(scale)
    return (x.float() / s).clamp_(-big, big).to(dtype)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """float32 values of a cache: ``cache * scale`` for fp8, ``cache`` itself (upcast) otherwise."""
    x = cache.float()
    if _is_fp8(cache.dtype) and scale is not None:
        x = x * (scale.reshape(()).float() if isinstance(scale, torch.Tensor) else float(scale))
    return x


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale) -> torch.Tensor:
    """``x`` in the cache's dtype: quantized with saturation for fp8 (scale ``None`` = 1), cast otherwise."""
    if _is_fp8(cache.dtype):
        return quantize_fp8(x, 1.0 if scale is None else scale, cache.dtype)
    return x.to(cache.dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVLayout | str = KVLayout.NHD,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Scatter new tokens into the paged cache in place.

    Args:
        k, v: ``[T, H_kv, D]`` new keys / values (cast to the cache dtype; fp8 caches: quantized,
            :func:`quantize_fp8` with ``k_scale`` / ``v_scale``, default 1).
        k_cache, v_cache: paged caches in ``layout``.
        slot_mapping: ``[T]`` int32/int64 slot per token; negative = padding, skipped.
    """
    kn, vn = to_nhd(k_cache, layout), to_nhd(v_cache, layout)
    num_pages, page_size, heads, dim = kn.shape
    if vn.shape != kn.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {list(k_cache.shape)}, got {list(v_cache.shape)}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be an int32 or int64 tensor, got {getattr(slot_mapping, 'dtype', type(slot_mapping))}"
        )
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [T], got shape {list(slot_mapping.shape)}")
    expect = [slot_mapping.shape[0], heads, dim]
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != expect:
            raise ValueError(f"{name} must have shape [T, H_kv, D] = {expect}, got {list(t.shape)}")
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_pages * page_size:
        raise ValueError(
            f"slot_mapping must be < num_pages * page_size = {num_pages * page_size}, got {int(slot_mapping.max())}"
        )
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, off = slots // page_size, slots % page_size
    kn[page, off] = _to_cache(k[keep], kn, k_scale)
    vn[page, off] = _to_cache(v[keep], vn, v_scale)


def write_kv_fixed_shape(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scratch_page: int,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """:func:`write_kv` (NHD ``[pages, P, H_kv, D]``) in fixed-shape torch ops: no host sync, no
    data-dependent shape. Padding tokens (slot < 0) go to the first slot of ``scratch_page`` (a page
    no request uses) and write back what is there, leaving it unchanged. ``k, v [>= T, H_kv, D]``.

    About 14 launches: fine on CPU; on a GPU use ``attnplug.core.kernels.kv_write.write_kv_paged``
    (one launch; ``docs/measured-choices.md`` has the two measured side by side).
    """
    T, page_size = slot_mapping.shape[0], k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = torch.where(keep, slot_mapping, scratch_page * page_size).long()
    page, off = slots // page_size, slots % page_size
    keep = keep[:, None, None]
    k_cache[page, off] = torch.where(keep, _to_cache(k[:T], k_cache, k_scale), k_cache[page, off])
    v_cache[page, off] = torch.where(keep, _to_cache(v[:T], v_cache, v_scale), v_cache[page, off])


def write_kv_capturable(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scratch_page: int = 0,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """:func:`write_kv` of ``k, v [>= T, H_kv, D]`` to ``slot_mapping [T]`` (negative = padding) in NHD
    ``k_cache / v_cache [pages, P, H_kv, D]``, with no host sync, so a CUDA graph can capture it: where
    Triton runs (CUDA, or the interpreter on CPU) one launch (``kernels.kv_write.write_kv_paged``), else
    :func:`write_kv_fixed_shape` (padding to ``scratch_page``). fp8 caches: quantized with saturation by
    ``k_scale`` / ``v_scale``. Both engine adapters write through it."""
    from .providers.triton import triton_runs_on  # noqa: PLC0415 - no triton import unless it runs

    if triton_runs_on(k_cache):
        from .kernels.kv_write import write_kv_paged  # noqa: PLC0415 - triton is optional

        write_kv_paged(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    write_kv_fixed_shape(k, v, k_cache, v_cache, slot_mapping, scratch_page, k_scale, v_scale)
