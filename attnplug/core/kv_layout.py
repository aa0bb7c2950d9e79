"""Paged KV-cache layouts, allocation and token scatter.

* ``NHD``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (vLLM / FlashInfer default).
* ``HND``: ``[num_pages, num_kv_heads, page_size, head_dim]``.

Slot ``s`` addresses token offset ``s % page_size`` of page ``s // page_size``.
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["KVLayout", "MAX_PAGE_SIZE", "kv_cache_shape", "to_nhd", "from_nhd", "allocate_kv_cache", "write_kv"]

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


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVLayout | str = KVLayout.NHD,
) -> None:
    """Scatter new tokens into the paged cache in place.

    Args:
        k, v: ``[T, H_kv, D]`` new keys / values (cast to the cache dtype).
        k_cache, v_cache: paged caches in ``layout``.
        slot_mapping: ``[T]`` int32/int64 slot per token; negative = padding, skipped.
    """
    kn, vn = to_nhd(k_cache, layout), to_nhd(v_cache, layout)
    num_pages, page_size, heads, dim = kn.shape
    if vn.shape != kn.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {list(k_cache.shape)}, got {list(v_cache.shape)}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be an int32 or int64 tensor, got {getattr(slot_mapping, 'dtype', type(slot_mapping))}")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [T], got shape {list(slot_mapping.shape)}")
    expect = [slot_mapping.shape[0], heads, dim]
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != expect:
            raise ValueError(f"{name} must have shape [T, H_kv, D] = {expect}, got {list(t.shape)}")
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_pages * page_size:
        raise ValueError(f"slot_mapping must be < num_pages * page_size = {num_pages * page_size}, got {int(slot_mapping.max())}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, off = slots // page_size, slots % page_size
    kn[page, off] = k[keep].to(kn.dtype)
    vn[page, off] = v[keep].to(vn.dtype)


def write_kv_fixed_shape(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    scratch_page: int,
) -> None:
    """:func:`write_kv` (NHD ``[pages, P, H_kv, D]``) in fixed-shape torch ops: no host sync, no
    data-dependent shape. Padding tokens (slot < 0) go to the first slot of ``scratch_page`` (a page
    no request uses) and write back what is there, leaving it unchanged. ``k, v [>= T, H_kv, D]``.

    About 14 launches: fine on CPU; on a GPU use ``attnplug.core.kernels.kv_write.write_kv_paged``
    (one launch; 32 layers of a decode step: 0.055 ms instead of 0.8 ms on the H200).
    """
    T, page_size = slot_mapping.shape[0], k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = torch.where(keep, slot_mapping, scratch_page * page_size).long()
    page, off = slots // page_size, slots % page_size
    keep = keep[:, None, None]
    k_cache[page, off] = torch.where(keep, k[:T].to(k_cache.dtype), k_cache[page, off])
    v_cache[page, off] = torch.where(keep, v[:T].to(v_cache.dtype), v_cache[page, off])
