"""KV-cache write of one decode step inside a CUDA graph: vLLM adapter's torch-op path vs the core's
one-launch Triton kernel (attnplug.core.kernels.kv_write), 32 layers of Llama-3-8B shape.

    python benchmarks/probes/kv_write_bench.py --out benchmarks/results/h200-kv-write-2026-11-29.json

Each variant is captured once per batch size as 32 consecutive layer writes into one
[2, blocks, 16, 8, 128] bf16 cache per layer (vLLM's layout, K/V as strided halves), then replayed;
ms = median over 50 replays (CUDA events). Both variants are checked equal to the core's write_kv first.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from attnplug.core.kernels.kv_write import write_kv_paged
from attnplug.core.kv_layout import write_kv, write_kv_fixed_shape

LAYERS, BLOCKS, P, H, D = 32, 4096, 16, 8, 128


def torch_path(k, v, kc, vc, slots):
    """The vLLM adapter's previous write: fixed-shape torch ops (padding to page 0)."""
    write_kv_fixed_shape(k, v, kc, vc, slots, 0)


def replay_ms(fn, caches, k, v, slots, reps=50):
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for c in caches:  # warm-up / compile outside the graph
            fn(k, v, c[0], c[1], slots)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in caches:
            fn(k, v, c[0], c[1], slots)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    caches = [torch.zeros(2, BLOCKS, P, H, D, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    rows = []
    for bs in (1, 8, 64):
        slots = torch.randperm(BLOCKS * P, device=dev)[:bs].to(torch.int64)
        slots[-1] = -1 if bs > 1 else slots[-1]  # one padding token
        kv = torch.randn(bs, 2 * H, D, device=dev, dtype=torch.bfloat16)
        k, v = kv[:, :H], kv[:, H:]
        for fn in (torch_path, write_kv_paged):
            ref = torch.zeros_like(caches[0])
            got = torch.zeros_like(caches[0])
            write_kv(k, v, ref[0], ref[1], slots)
            fn(k, v, got[0], got[1], slots)
            assert torch.equal(ref, got), fn.__name__
        t_torch = replay_ms(torch_path, caches, k, v, slots)
        t_triton = replay_ms(write_kv_paged, caches, k, v, slots)
        rows.append(
            {
                "batch": bs,
                "layers": LAYERS,
                "torch_ops_ms": round(t_torch, 4),
                "triton_ms": round(t_triton, 4),
                "saved_ms_per_step": round(t_torch - t_triton, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
