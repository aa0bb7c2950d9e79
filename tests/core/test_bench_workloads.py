"""The benchmark's inputs (``attnplug/bench/workloads.py``), engine-free: rows that name their own heads."""

from __future__ import annotations

import torch

from attnplug.bench.workloads import FULL_ROWS, QUICK_CONFIG, Row, build
from attnplug.core import AttentionConfig


def test_rows_with_their_own_heads_build():
    """A row's own head dim replaces the run's, the value head dim with it (the d64 / d256 rows; the head
    counts cut so that the CPU builds them quickly)."""
    config = AttentionConfig(**QUICK_CONFIG)
    own = sorted({r.heads for r in FULL_ROWS if r.heads})
    assert {d for _, _, d in own} >= {64, 256}
    for hq, hkv, d in own:
        row = Row(f"tiny d{d}", "decode", 2, 1, 20, heads=(hq // hkv, 1, d))
        work = build(row, config, torch.device("cpu"))
        assert (work.config.head_dim, work.config.head_dim_v) == (d, d), row
        assert work.q.shape[1:] == (hq // hkv, d) and work.k_cache.shape[-1] == d, row
