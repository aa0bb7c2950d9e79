"""Host -> device transfer of a plan's host arrays: one packed buffer, one asynchronous copy.

A plan builds a handful of small index arrays on the host (numpy) that its kernels read on the
device. :class:`Transfer` packs them into one host buffer and issues one ``non_blocking`` copy
from it: the host does not wait for the device (a blocking ``Tensor.to(device)`` waits for every
kernel queued before it). ``make_plan`` and the provider's ``plan`` add to one ``Transfer`` and
``PagedAttention.plan`` sends it once; :func:`to_device` is one ``Transfer`` sent at once. The buffer is pageable on purpose: the driver copies a pageable source
of up to 64 KB into its own staging memory and returns, which on the H200's host measured faster
than staging through page-locked memory (``benchmarks/NOTES.md``, "Eighth session": "plan()'s host->device copies").
"""
from __future__ import annotations

from typing import Sequence

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


def packed_bytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes of ``arrays`` packed by :class:`Transfer` (each one 16-byte aligned)."""
    return _layout(arrays)[1]


class Transfer:
    """Host arrays gathered over one ``plan()`` and sent to ``device`` by one asynchronous copy.

    ``add`` packs arrays into a host buffer of ``capacity`` bytes and returns, at once, their views of a
    device buffer of the same size; the values arrive when ``send`` issues the one ``non_blocking``
    copy of the bytes used. Nothing may read the views before ``send``. On the CPU there is no copy:
    ``add`` returns the arrays themselves.
    """

    def __init__(self, device: torch.device, capacity: int):
        self.device, self.capacity, self.used, self.sent = device, capacity, 0, False
        if device.type != "cpu":
            self._host = np.empty(max(capacity, 1), dtype=np.uint8)
            self._dev = torch.empty(max(capacity, 1), dtype=torch.uint8, device=device)

    def room(self, arrays: Sequence[np.ndarray]) -> bool:
        """``arrays`` fit in what is left (always on the CPU)."""
        return self.device.type == "cpu" or self.used + _layout(arrays)[1] <= self.capacity

    def add(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """``arrays`` (1-D numpy) as ``[n]`` tensors of the same dtypes on the device (valid after
        :meth:`send`); the host copies them now, so the caller may change its arrays at once."""
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
        if self.sent:
            raise RuntimeError("attnplug staging: add() after send()")
        offsets, total = _layout(arrays)
        if self.used + total > self.capacity:
            raise ValueError(f"attnplug staging: {total} bytes exceed the {self.capacity - self.used} left")
        base, self.used = self.used, self.used + total
        for a, o in zip(arrays, offsets):
            self._host[base + o : base + o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return [self._dev[base + o : base + o + a.nbytes].view(_TORCH_DTYPE[a.dtype]) for a, o in zip(arrays, offsets)]

    def send(self) -> None:
        """Issue the one copy of the bytes added (none on the CPU, or when nothing was added)."""
        if self.sent:
            return
        self.sent = True
        if self.device.type != "cpu" and self.used:
            self._dev[: self.used].copy_(torch.from_numpy(self._host[: self.used]), non_blocking=True)


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (1-D numpy, ``[n]`` each) as ``[n]`` tensors of the same dtype on ``device``, in the
    order given: on the CPU the arrays themselves (shared memory, no copy); elsewhere views of one
    device buffer filled by one asynchronous copy of a packed host buffer (a new one per call, so
    the caller may change its arrays as soon as this returns)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
    dt = arrays[0].dtype
    if all(a.dtype == dt for a in arrays) and dt in _TORCH_DTYPE:  # one dtype: back to back
        dev = torch.from_numpy(np.concatenate(arrays)).to(device, non_blocking=True)
        out, o = [], 0
        for a in arrays:
            out.append(dev[o : o + a.shape[0]])
            o += a.shape[0]
        return out
    t = Transfer(device, _layout(arrays)[1])
    out = t.add(arrays)
    t.send()
    return out
