"""Host -> device transfer of a plan's host arrays: one page-locked slot, one asynchronous copy.

A plan builds a handful of small index arrays on the host (numpy) that its kernels read on the
device. Copied one by one from pageable memory, each ``Tensor.to(device)`` is a synchronous driver
copy through a staging buffer of the driver's. :func:`to_device` packs them into one slot of a small
ring of page-locked buffers kept per device and issues one ``cudaMemcpyAsync`` into a fresh device
buffer (torch's caching allocator): the host returns once the copy is queued on the current stream.
An event recorded behind each copy guards its slot: a slot is refilled only after its last copy has
run (one forward later, in practice always done).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: in a mixed-dtype transfer every array starts 16-byte aligned
SLOTS = 8  # page-locked slots per device, used round-robin
_MIN_SLOT = 1 << 16  # bytes; a slot grows to the next power of two that holds the transfer

_TORCH_DTYPE = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float32): torch.float32,
}


class _Slot:
    __slots__ = ("host", "raw", "event")

    def __init__(self, nbytes: int):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # [nbytes] page-locked
        self.raw = self.host.numpy()
        self.event: torch.cuda.Event | None = None  # recorded behind the slot's last copy


class _Ring:
    def __init__(self):
        self.slots: list[_Slot | None] = [None] * SLOTS
        self.next = 0

    def take(self, nbytes: int) -> _Slot:
        """The next slot, at least ``nbytes`` large, once its previous copy has run."""
        i, self.next = self.next, (self.next + 1) % SLOTS
        slot = self.slots[i]
        if slot is not None and slot.event is not None:
            slot.event.synchronize()
        if slot is None or slot.raw.shape[0] < nbytes:
            slot = self.slots[i] = _Slot(max(_MIN_SLOT, 1 << (nbytes - 1).bit_length()))
        return slot


_RINGS: dict[torch.device, _Ring] = {}


def _ring(device: torch.device) -> _Ring:
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = _Ring()
    return ring


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offsets of ``arrays`` packed with each one 16-byte aligned, and the total."""
    offsets, end = [], 0
    for a in arrays:
        if a.dtype not in _TORCH_DTYPE:
            raise TypeError(f"attnplug staging: dtype {a.dtype} is not one of {sorted(map(str, _TORCH_DTYPE))}")
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (1-D numpy, ``[n]`` each) as ``[n]`` tensors of the same dtype on ``device``, in the
    order given: on the CPU the arrays themselves (shared memory, no copy); elsewhere views of one
    device buffer filled by one asynchronous copy from a page-locked slot. The caller may change
    its arrays as soon as this returns."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
    ring = _ring(device)
    dt = arrays[0].dtype
    if all(a.dtype == dt for a in arrays) and dt in _TORCH_DTYPE:  # one dtype: packed back to back
        n = sum(a.shape[0] for a in arrays)
        slot = ring.take(max(n, 1) * dt.itemsize)
        np.concatenate(arrays, out=slot.raw[: n * dt.itemsize].view(dt))
        dev = torch.empty(n, dtype=_TORCH_DTYPE[dt], device=device)
        dev.copy_(slot.host[: n * dt.itemsize].view(_TORCH_DTYPE[dt]), non_blocking=True)
        out, o = [], 0
        for a in arrays:
            out.append(dev[o : o + a.shape[0]])
            o += a.shape[0]
    else:
        offsets, total = _layout(arrays)
        slot = ring.take(max(total, 1))
        for a, o in zip(arrays, offsets):
            slot.raw[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = torch.empty(total, dtype=torch.uint8, device=device)
        dev.copy_(slot.host[:total], non_blocking=True)
        out = [dev[o : o + a.nbytes].view(_TORCH_DTYPE[a.dtype]) for a, o in zip(arrays, offsets)]
    _guard(slot, device)
    return out


def copy_to(dsts: Sequence[torch.Tensor], arrays: Sequence[np.ndarray]) -> None:
    """``dsts[i][:] = arrays[i]`` for device tensors ``dsts`` (``[n_i]``, the arrays' dtypes), through
    one page-locked slot, asynchronously (CPU tensors: plain copies)."""
    device = dsts[0].device if dsts else torch.device("cpu")
    if device.type == "cpu":
        for d, a in zip(dsts, arrays):
            d.copy_(torch.from_numpy(np.ascontiguousarray(a).reshape(-1)))
        return
    ring = _ring(device)
    offsets, total = _layout(arrays)
    slot = ring.take(max(total, 1))
    for d, a, o in zip(dsts, arrays, offsets):
        slot.raw[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        d.copy_(slot.host[o : o + a.nbytes].view(_TORCH_DTYPE[a.dtype]), non_blocking=True)
    _guard(slot, device)


def _guard(slot: _Slot, device: torch.device) -> None:
    """Record the slot's event behind the copies just queued on ``device``'s current stream."""
    if slot.event is None:
        slot.event = torch.cuda.Event()
    slot.event.record(torch.cuda.current_stream(device))
