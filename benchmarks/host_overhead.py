"""Where a short decode row's time goes: GPU time vs the host's launch work, per implementation.

    python benchmarks/host_overhead.py --out benchmarks/results/h200-host-overhead-DATE.json   # CUDA only

For each (row, implementation) of the benchmark (``attnplug.bench``'s rows and impls): ``ms`` the
benchmark's own timer (``do_bench``, L2 flushed: host-bound calls show their host time), ``graph_ms``
the same call replayed from a CUDA graph (GPU time alone; ``null`` when the call cannot be captured),
``host_us`` the host's time per call (200 calls back to back, no sync inside), and ``kernels`` the
CUDA kernels one call launches with their GPU microseconds (``torch.profiler``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from attnplug.bench import impls as I
from attnplug.bench import workloads as W
from attnplug.core import AttentionConfig

ROWS = ["decode 1x32768", "decode 1x32768 fp8", "decode 64x4096 fp8"]
IMPLS = [
    "attnplug.triton",
    "attnplug_kernel.triton_fp8",
    "attnplug.fa3",
    "fa3.paged",
    "attnplug.flashinfer",
    "flashinfer.decode_tc",
]


def kernels(fn) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.key[:90], round(e.device_time_total, 1)) for e in prof.key_averages() if e.device_time_total > 0]


def main() -> None:
    import triton.testing  # noqa: PLC0415

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = AttentionConfig(**W.FULL_CONFIG)
    rows = {r.name: r for r in W.FULL_ROWS}
    impls = {i.name: i for i in I.IMPLS}
    res = []
    for rname in ROWS:
        work = W.build(rows[rname], config, dev)
        for iname in IMPLS:
            entry = dict(row=rname, impl=iname)
            try:
                fn = impls[iname].make(work)
            except Exception as e:  # Unavailable / NotApplicable / a library error: recorded
                entry["skip"] = f"{type(e).__name__}: {e}"[:200]
                res.append(entry)
                print(entry, flush=True)
                continue
            fn()
            torch.cuda.synchronize()
            entry["ms"] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            try:
                entry["graph_ms"] = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            except Exception as e:
                entry["graph_ms"], entry["graph_error"] = None, f"{type(e).__name__}: {e}"[:200]
                torch.cuda.synchronize()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            entry["host_us"] = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            entry["kernels"] = kernels(fn)
            res.append(entry)
            print(json.dumps(entry), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=res), f, indent=1)


if __name__ == "__main__":
    main()
