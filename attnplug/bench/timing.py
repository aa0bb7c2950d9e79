"""Timers (median of CUDA-event timings with L2 flush via ``triton.testing.do_bench``) and ceilings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def bench_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn``. CUDA: ``do_bench`` (25 ms warmup, L2 flushed before each call);
    CPU: median of a few wall-clock calls (smoke runs only)."""
    if device.type == "cuda":
        import triton.testing  # noqa: PLC0415

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class NotCapturable(Exception):
    """An implementation that cannot be captured in a CUDA graph as it is (``fn.not_capturable``: why)."""


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured in one CUDA graph: the returned callable replays it (one host launch), so the
    CUDA-event timing of :func:`bench_ms` measures the kernels without the host's launch gaps, as the
    engines replay decode. ``fn`` runs twice on a side stream first (JIT, autotuning); it must be
    capturable (launches only), else the capture raises. Returns ``fn`` itself when it is already a graph
    replay (``fn.graphed``); CPU: ``fn``. Raises :class:`NotCapturable` for ``fn.not_capturable``;
    ``fn.for_graphs()`` (when set) builds the capturable twin that is captured instead."""
    if getattr(fn, "not_capturable", None):
        raise NotCapturable(fn.not_capturable)
    if device.type != "cuda" or getattr(fn, "graphed", False):
        return fn
    if getattr(fn, "for_graphs", None) is not None:  # the capturable twin of an eager-only implementation
        fn = fn.for_graphs()
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()

    def replay():
        g.replay()
        return out

    replay.graph = g
    return replay


def _copy_ms(n: int, device: torch.device) -> float:
    x = torch.randn(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    return bench_ms(lambda: y.copy_(x), device)


def ceilings(device: torch.device, quick: bool) -> dict:
    """Device copy GB/s (1 GiB bf16, bytes read + written) and bf16 matmul TFLOP/s (8192^3).

    ``quick``: 16 MiB copy and a 256^3 float32 matmul (CPU smoke run)."""
    res = {}
    n = (8 if quick else 512) * 1024 * 1024  # bf16 elements: 16 MiB or 1 GiB
    res["copy_bytes"] = 2 * n
    res["copy_GBps"] = 2 * res["copy_bytes"] / _copy_ms(n, device) / 1e6
    m = 256 if quick else 8192
    dt = torch.float32 if quick else torch.bfloat16
    a = torch.randn(m, m, dtype=dt, device=device)
    b = torch.randn(m, m, dtype=dt, device=device)
    ms = bench_ms(lambda: a @ b, device)
    res["matmul_TFLOPs"] = 2 * m**3 / ms / 1e9
    res["matmul_shape"] = f"{m}^3 {str(dt).replace('torch.', '')}"
    return res
