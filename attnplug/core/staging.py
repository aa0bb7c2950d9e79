"""Host -> device transfer of a plan's host arrays: one pinned buffer, one asynchronous copy.

A plan builds a handful of small index arrays on the host (numpy) that its kernels read on the
device. Copied one by one from pageable memory, each ``Tensor.to(device)`` is a synchronous
driver copy through a staging buffer of the driver's (tens of microseconds each on a busy host).
:func:`to_device` packs them into one page-locked buffer from torch's caching host allocator and
issues one ``cudaMemcpyAsync``: the host returns as soon as the copy is queued on the current
stream. The caching host allocator records an event on that stream when the copy is issued and
hands the buffer out again only after the event has fired, so a buffer is never overwritten while
its copy is in flight.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: every array starts 16-byte aligned in the buffer (a view of any dtype is legal)

_TORCH_DTYPE = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float32): torch.float32,
}


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for a in arrays:
        if a.dtype not in _TORCH_DTYPE:
            raise TypeError(f"attnplug staging: dtype {a.dtype} is not one of {sorted(map(str, _TORCH_DTYPE))}")
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def _pack(arrays: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    offsets, total = _layout(arrays)
    buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    raw = buf.numpy()
    for a, o in zip(arrays, offsets):
        raw[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buf, offsets


def pinned(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """``arrays`` (1-D numpy) copied into one page-locked host buffer; returns a 1-D tensor view of
    it per array, of the array's dtype and length (sources for ``copy_(..., non_blocking=True)``)."""
    buf, offsets = _pack(arrays)
    return [_view(buf, o, a) for a, o in zip(arrays, offsets)]


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (1-D numpy) as tensors on ``device``: on the CPU the arrays themselves (shared
    memory, no copy); elsewhere views of one device buffer filled by one asynchronous copy from a
    pinned host buffer (:func:`pinned`), in the order given. ``[n]`` in, ``[n]`` of the same dtype out."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
    buf, offsets = _pack(arrays)
    dev = buf.to(device, non_blocking=True)
    return [_view(dev, o, a) for a, o in zip(arrays, offsets)]


def _view(buf: torch.Tensor, offset: int, a: np.ndarray) -> torch.Tensor:
    return buf[offset : offset + a.nbytes].view(_TORCH_DTYPE[a.dtype])
