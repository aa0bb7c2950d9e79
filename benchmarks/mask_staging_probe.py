"""Host cost of a verify tree's custom mask in ``make_plan`` on a GPU (issue 14): the mask staged as its
hidden positions (expanded on the device) against its bytes, in interleaved rounds of one process, for
``plan_cost.py``'s ``verify_tree`` workload (64 requests, q 4, prefix 256..2048, 286,036 mask bytes).

    python benchmarks/mask_staging_probe.py --out benchmarks/results/mask-staging-probe-h200.json

Rows (host wall time per call, as ``plan_cost.time_calls`` reports it): ``make_plan`` with each staging,
``make_plan`` with each staging after a device synchronize outside the timed call (no queued work),
the expansion alone (``torch.ones`` + ``index_fill_``), the mask scan alone (``_hidden_np``), and the
``triton`` provider's ``plan`` on a ready plan (unrelated to the mask: the host's noise floor). Then a
``cProfile`` of 300 ``make_plan`` calls per staging (top functions by own time)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import plan_cost  # noqa: E402
from attnplug.core import PagedAttention, make_plan  # noqa: E402
from attnplug.core import plan as plan_mod  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    batch, num_pages = plan_cost.workload("verify_tree")
    cfg = plan_cost.CONFIG
    sparse_min = plan_mod._SPARSE_MASK_MIN_BYTES

    def staged(on: bool):
        def fn():
            plan_mod._SPARSE_MASK_MIN_BYTES = sparse_min if on else 1 << 62
            return make_plan(cfg, batch, num_pages=num_pages, device=dev)
        return fn

    def synced(fn):
        def g():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter_ns()
            fn()
            return time.perf_counter_ns() - t0
        return g

    mb = batch.custom_mask.numpy()
    hidden = plan_mod._hidden_np(mb)
    hidden_d = torch.from_numpy(hidden).to(dev)
    attn = PagedAttention(cfg, "triton", dev)
    p = make_plan(cfg, batch, num_pages=num_pages, device=dev)
    fns = {
        "make_plan[positions]": staged(True),
        "make_plan[bytes]": staged(False),
        "expand_mask": lambda: plan_mod.expand_mask(mb.shape[0], hidden_d),
        "hidden_np": lambda: plan_mod._hidden_np(mb),
        "provider.plan[triton]": lambda: attn.provider.plan(p),
    }
    res = {"hidden": int(hidden.shape[0]), "mask_bytes": int(mb.shape[0]), "load_avg_at_start": os.getloadavg(),
           "rows": plan_cost.time_calls(fns, 200, args.calls)}
    for name, on in (("positions", True), ("bytes", False)):  # no queued device work before each call
        fn, w = synced(staged(on)), []
        for _ in range(200):
            fn()
        for _ in range(args.calls // 2):
            w.append(fn() / 1e3)
        res["rows"][f"make_plan[{name}] after sync"] = {"median_us": round(float(np.median(w)), 2),
                                                       "p10_us": round(float(np.percentile(w, 10)), 2)}
    for name, on in (("positions", True), ("bytes", False)):
        fn, pr, s = staged(on), cProfile.Profile(), io.StringIO()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        res[f"profile[{name}]"] = s.getvalue().splitlines()
    plan_mod._SPARSE_MASK_MIN_BYTES = sparse_min
    res["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for k, v in res["rows"].items():
        print(f"{k:34s} {v}")
    for name in ("positions", "bytes"):
        print(f"-- profile[{name}]")
        print("\n".join(res[f"profile[{name}]"][:40]))


if __name__ == "__main__":
    main()
