"""Host -> device transfer of a plan's host arrays: one packed buffer, one asynchronous copy.

A plan builds a handful of small index arrays on the host (numpy) that its kernels read on the
device. :func:`to_device` packs them into one host buffer and issues one ``non_blocking`` copy
from it: the host does not wait for the device (a blocking ``Tensor.to(device)`` waits for every
kernel queued before it). The buffer is pageable on purpose: the driver copies a pageable source
of up to 64 KB into its own staging memory and returns, faster than staging through page-locked
memory (``docs/measured-choices.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: in a mixed-dtype transfer every array starts 16-byte aligned

_TORCH_DTYPE = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float32): torch.float32,
}


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offsets of ``arrays`` packed with each one 16-byte aligned, and the total."""
    offsets, end = [], 0
    for a in arrays:
        if a.dtype not in _TORCH_DTYPE:
            raise TypeError(f"attnplug staging: dtype {a.dtype} is not one of {sorted(map(str, _TORCH_DTYPE))}")
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def _one_dtype(arrays: Sequence[np.ndarray]) -> bool:
    dt = arrays[0].dtype
    return dt in _TORCH_DTYPE and all(a.dtype == dt for a in arrays)


def _pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The host buffer :func:`to_device` copies: ``arrays`` back to back when they share a dtype, else
    their bytes at the :func:`_layout` offsets (``uint8``)."""
    if _one_dtype(arrays):
        return np.concatenate(arrays)
    offsets, total = _layout(arrays)
    raw = np.empty(total, dtype=np.uint8)
    for a, o in zip(arrays, offsets):
        raw[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return raw


def _views(buf: torch.Tensor, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """``arrays``' views of ``buf`` (a tensor of :func:`_pack`'s buffer), made by one ``split`` call
    (each slice of a CUDA tensor costs host time; one call instead of one a view)."""
    if _one_dtype(arrays):
        return list(buf.split([a.shape[0] for a in arrays]))
    offsets, total = _layout(arrays)
    sizes = []  # each array's bytes, then its padding up to the next one's offset
    for a, o, nxt in zip(arrays, offsets, offsets[1:] + [total]):
        sizes += [a.nbytes, nxt - o - a.nbytes]
    parts = buf.split(sizes)[::2]
    return [p if a.dtype == np.uint8 else p.view(_TORCH_DTYPE[a.dtype]) for a, p in zip(arrays, parts)]


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (1-D numpy, ``[n]`` each) as ``[n]`` tensors of the same dtype on ``device``, in the
    order given: on the CPU the arrays themselves (shared memory, no copy); elsewhere views of one
    device buffer filled by one asynchronous copy of a packed host buffer (a new one per call, so
    the caller may change its arrays as soon as this returns)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
    return _views(torch.from_numpy(_pack(arrays)).to(device, non_blocking=True), arrays)
