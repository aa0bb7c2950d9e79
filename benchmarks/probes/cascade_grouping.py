"""Host cost of the cascade decision at ``plan()``: grouping (and the whole split) for the benchmark's
shared-prefix shape, and the cost when nothing is shared.

    python benchmarks/probes/cascade_grouping.py [--out DIR]     # CPU only; JSON to DIR (default: .)

Medians of warm per-call times (``time.perf_counter``), 64 requests x (8192 shared + 256 unique)
tokens at page 16 (the issue's shape), the same with nothing shared, and four groups of 16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, make_plan
from attnplug.core.cascade import find_groups, plan_cascade, shareable_pages

CASES = {
    "64 requests sharing 8192 tokens": [(64, 8192)],
    "64 requests, nothing shared": [(1, 8192)] * 64,
    "4 groups of 16 sharing 2048": [(16, 2048)] * 4,
}


def median_us(fn, n: int) -> float:
    for _ in range(max(20, n // 10)):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    cfg = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    res = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "rows": {}}
    for name, spec in CASES.items():
        batch, *_, n = shared_prefix_batch(cfg, ForwardMode.DECODE, prompts(spec, 256), device="meta")
        plan = make_plan(cfg, batch, n, device="cpu")

        def group():
            return find_groups(plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy(), shareable_pages(plan))

        groups = group()
        res["rows"][name] = dict(
            groups=[(int(g.members.size), int(g.pages)) for g in groups],
            plan_cascade_us=median_us(lambda: plan_cascade(plan, "auto"), a.calls // 4),
            find_groups_us=median_us(group, a.calls),
        )
        print(
            f"{name:34s} groups {res['rows'][name]['groups']}  "
            f"find_groups {res['rows'][name]['find_groups_us']:7.1f} us"
            f"  plan_cascade (decision + split) {res['rows'][name]['plan_cascade_us']:7.1f} us",
            flush=True,
        )
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "cascade-grouping.json")
    json.dump(res, open(path, "w"), indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
