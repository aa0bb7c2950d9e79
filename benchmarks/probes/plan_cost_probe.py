"""Where ``make_plan``'s host time goes on a CUDA host (issue 14): its Python profile, and the torch /
numpy primitives of its host -> device staging timed alone (median of ``--calls`` warm calls, us).

    python benchmarks/probes/plan_cost_probe.py --out benchmarks/results/plan-cost-probe-h200.json

Primitives (36 KB = the decode workload's staged arrays, 4 KB a small plan): a pageable
``from_numpy(a).to(dev, non_blocking=True)``; the same into a preallocated device buffer (``copy_``);
through a preallocated page-locked buffer (numpy copy into it, then ``copy_``, no event); one slice
and one ``view(dtype)`` of a device tensor; ``torch.empty`` on the device; ``np.concatenate`` of the
five index arrays. ``make_plan`` on ``cpu`` (no staging) and on ``cuda`` bracket the staging's share.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "probes"))

from plan_cost import CONFIG, time_calls, workload  # noqa: E402

from attnplug.core import make_plan  # noqa: E402


def median_us(fn, calls: int, warmup: int = 200) -> float:
    """Median host wall time of one call of ``fn`` (``plan_cost.time_calls``), in us."""
    return time_calls({"fn": fn}, warmup, calls)["fn"]["median_us"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    res: dict = {"device": str(dev), "torch": torch.__version__, "primitives_us": {}, "make_plan_us": {}}
    prim = res["primitives_us"]
    for kb in (4, 36):
        a = np.arange(kb * 256, dtype=np.int32)
        dst = torch.empty(a.shape[0], dtype=torch.int32, device=dev)
        pinned = torch.empty(a.shape[0], dtype=torch.int32, pin_memory=dev.type == "cuda")
        pin_np = pinned.numpy()
        prim[f"to_nonblocking_{kb}KB"] = median_us(lambda: torch.from_numpy(a).to(dev, non_blocking=True), args.calls)
        prim[f"copy_into_prealloc_{kb}KB"] = median_us(
            lambda: dst.copy_(torch.from_numpy(a), non_blocking=True), args.calls
        )

        def via_pinned():
            pin_np[:] = a
            dst.copy_(pinned, non_blocking=True)

        prim[f"via_prealloc_pinned_{kb}KB"] = median_us(via_pinned, args.calls)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    t = torch.empty(9000, dtype=torch.int32, device=dev)
    prim["slice"] = median_us(lambda: t[100:200], args.calls)
    prim["view_dtype"] = median_us(lambda: t.view(torch.float32), args.calls)
    prim["empty_9000_int32"] = median_us(lambda: torch.empty(9000, dtype=torch.int32, device=dev), args.calls)
    parts = [
        np.arange(65, dtype=np.int32),
        np.arange(65, dtype=np.int32),
        np.arange(64, dtype=np.int32),
        np.arange(64, dtype=np.int32),
        np.arange(9000, dtype=np.int32),
    ]
    prim["np_concatenate_5"] = median_us(lambda: np.concatenate(parts), args.calls)
    profiles = {}
    for kind in ("decode", "extend", "verify_tree"):
        batch, n = workload(kind)
        for d in ("cpu", args.device):
            res["make_plan_us"][f"{kind}[{d}]"] = median_us(lambda: make_plan(CONFIG, batch, n, device=d), args.calls)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(1000):
            make_plan(CONFIG, batch, n, device=dev)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        profiles[kind] = s.getvalue()
    print(json.dumps(res, indent=1))
    for kind, text in profiles.items():
        print(f"--- cProfile of 1000 make_plan calls, {kind}, device {dev} (tottime, s) ---")
        print("\n".join(line for line in text.splitlines() if line.strip())[:3000])
    res["profiles"] = profiles
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
