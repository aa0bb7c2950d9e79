"""``engine_glue.LateCounts``: the proof markers' device counters, summed over every graph family
read, without a host sync (CUDA: the newest landed copy; CPU: at once)."""

from __future__ import annotations

import pytest
import torch

from attnplug.engine_glue import LateCounts


def test_sums_every_tensor_read_and_follows_updates():
    late = LateCounts()
    a, b = torch.tensor([1, 16], dtype=torch.int64), torch.tensor([2, 8], dtype=torch.int64)
    assert late.read(a) == [1, 16]
    assert late.read(b) == [3, 24], "a drafter's family and the target's add up"
    a += torch.tensor([1, 4])
    assert late.read(a) == [4, 28]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the no-sync path needs CUDA")
def test_cuda_reads_land_without_a_sync():
    late = LateCounts()
    c = torch.tensor([5, 80], dtype=torch.int64, device="cuda")
    first = late.read(c)  # queued, maybe not landed yet
    assert first in ([0, 0], [5, 80])
    torch.cuda.synchronize()
    assert late.read(c) == [5, 80]
