"""Soak (issue 17 §4): many plan/run cycles with changing batch shapes and many graph replays;
host memory (tracemalloc, RSS) and device memory (allocated / reserved) must not grow after warm-up.

    # CPU: reference plan/run, triton replays
    python -m attnplug.bench.soak --out benchmarks/results/soak-cpu.json
    python -m attnplug.bench.soak --provider triton --cycles 10000 --replays 10000 ...     # every cycle through triton
    python -m attnplug.bench.soak --device cuda --provider triton --out soak-h200.json     # GPU: real CUDA graphs

Phase ``plan_run``: every cycle draws a new random batch (mode EXTEND / DECODE / MIXED / TARGET_VERIFY
with a tree mask, 1..``max_batch`` requests, ragged lengths, permuted pages) and runs
``PagedAttention.plan`` + one ``run`` per layer over a fixed cache. Phase ``graph_replay``: a
``GraphState`` (decode, batch sizes 1..``max_batch`` captured) gets ``update`` (host batch) or
``update_from_block_table`` (device table, every other replay) then ``run`` (on CUDA: the captured
graph's ``replay``), with a random real batch size ``<= bs``.

Memory is sampled every ``--sample-every`` iterations, each time right after the same fixed batch
(so the live plan and tensors are alike at every sample): ``tracemalloc`` current bytes (Python
objects and numpy buffers), also without what ``triton``'s own code allocated; ``compiled``, the
Triton specializations compiled so far (the JIT cache grows by one whenever a new shape class
arrives, also after warm-up, and keeps it); RSS (``/proc/self/statm``: also torch's host allocator
and the loaded kernel binaries); on CUDA ``torch.cuda.memory_allocated`` / ``memory_reserved``.
Growth = last sample minus the first sample after warm-up (``--warmup`` iterations); the largest
sample after warm-up, and the growth over the intervals without a compile, are reported too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

import torch

from ..core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention
from ..core import pages as pg
from ..core.cuda_graph import GraphState
from .workloads import random_tree_mask

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def traced_outside_triton() -> int:
    """Bytes tracemalloc holds that were not allocated by code of the ``triton`` package itself (the
    innermost frame): the Python heap without most of Triton's JIT cache (each compiled
    specialization keeps its binary and IR texts, a few MB, for the life of the process). Triton's
    allocations made through the standard library (json, pickle, paths) still count here; the
    compile-free growth (:meth:`Series.summary`) is the exact test."""
    if not tracemalloc.is_tracing():
        return 0
    triton_dir = f"{os.sep}triton{os.sep}"
    return sum(
        st.size
        for st in tracemalloc.take_snapshot().statistics("filename")
        if triton_dir not in (st.traceback[0].filename if st.traceback else "")
    )


def compiled_kernels() -> int:
    """Triton specializations compiled so far for attnplug's kernels (0 under the interpreter)."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("attnplug.core.kernels.") or mod is None:
            continue
        for obj in vars(mod).values():
            for caches in getattr(obj, "device_caches", {}).values():
                n += len(caches[0])  # (kernel_cache, kernel_key_cache, target, backend, binder)
    return n


@dataclass
class Series:
    """Memory samples of one phase."""

    warmup: int
    sample_every: int = 250
    iters: list[int] = field(default_factory=list)
    traced: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    cuda_alloc: list[int] = field(default_factory=list)
    cuda_reserved: list[int] = field(default_factory=list)
    traced_outside_triton: list[int] = field(default_factory=list)
    compiled: list[int] = field(default_factory=list)

    def sample(self, it: int, device: torch.device) -> None:
        gc.collect()
        self.iters.append(it)
        self.traced.append(tracemalloc.get_traced_memory()[0])
        self.traced_outside_triton.append(traced_outside_triton())
        self.compiled.append(compiled_kernels())
        self.rss.append(rss_bytes())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.cuda_alloc.append(torch.cuda.memory_allocated(device))
            self.cuda_reserved.append(torch.cuda.memory_reserved(device))

    def iterations(self, n: int, device: torch.device, deadline: float | None = None):
        """Yield ``0..n-1``, sampling memory every ``sample_every`` iterations and at the end; stop early
        past ``deadline`` (once two warm-ups are done), at a sample."""
        for it in range(n + 1):
            at_sample = it % self.sample_every == 0 or it == n
            if at_sample:
                self.sample(it, device)
            if it == n:
                return
            if at_sample and deadline is not None and time.time() > deadline and it >= 2 * self.warmup:
                return
            yield it

    def summary(self) -> dict:
        """Per metric: value at warm-up end, at the end, growth (end - warm-up), max after warm-up -
        warm-up, and ``growth_without_compiles``: the growth summed over the sample intervals in
        which no Triton specialization was compiled (a compiled kernel stays cached for the process's
        life; whatever else grows is attnplug's, torch's or a leak). Equal to ``growth`` where nothing
        compiles (CPU)."""
        first = next(i for i, it in enumerate(self.iters) if it >= self.warmup)
        out = {"samples": len(self.iters), "warmup_iters": self.warmup, "iters": self.iters[-1]}
        c = self.compiled[first:]
        for name in ("traced", "traced_outside_triton", "compiled", "rss", "cuda_alloc", "cuda_reserved"):
            s = getattr(self, name)
            if s:
                after = s[first:]
                quiet = sum(after[i] - after[i - 1] for i in range(1, len(after)) if c[i] == c[i - 1])
                out[name] = dict(
                    at_warmup=after[0],
                    end=after[-1],
                    growth=after[-1] - after[0],
                    max_over_warmup=max(after) - after[0],
                    growth_without_compiles=quiet,
                )
        return out


def random_batch(
    gen: torch.Generator,
    config: AttentionConfig,
    max_batch: int,
    max_q: int,
    max_prefix: int,
    num_pages: int,
    mode: ForwardMode | None = None,
) -> BatchMetadata:
    """A random ragged batch (host int32 metadata) over a cache of ``num_pages`` pages."""
    P = config.page_size
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    if mode is None:
        mode = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY][r(0, 3)]
    B = r(1, max_batch)
    q = [1 if mode == ForwardMode.DECODE else r(1, max_q) for _ in range(B)]
    if mode == ForwardMode.MIXED:
        q = [x if r(0, 1) else 1 for x in q]
    kv = torch.tensor([x + r(0, max_prefix) for x in q], dtype=torch.int32)
    npg = pg.num_pages(kv, P)
    ids = torch.randperm(num_pages, generator=gen)[: int(npg.sum())].to(torch.int32)
    mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        blocks = []
        for ql, kl in zip(q, kv.tolist()):
            m = torch.ones(ql, kl, dtype=torch.bool)
            m[:, kl - ql :] = random_tree_mask(ql, gen)
            blocks.append(m.flatten())
        mask = torch.cat(blocks)
    qo = pg.indptr_from_counts(torch.tensor(q, dtype=torch.int32))
    return BatchMetadata(mode, qo, pg.indptr_from_counts(npg), ids, pg.last_page_len(kv, P), custom_mask=mask)


def _caches(config: AttentionConfig, num_pages: int, gen: torch.Generator, device: torch.device):
    """Random K and V caches of ``num_pages`` pages, drawn on ``device`` (seeded from ``gen``)."""
    dgen = torch.Generator(device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return tuple(
        torch.randn(config.kv_cache_shape(num_pages), generator=dgen, device=device, dtype=config.dtype)
        for _ in range(2)
    )


def soak_plan_run(
    config: AttentionConfig,
    provider: str,
    device: torch.device,
    cycles: int,
    warmup: int,
    sample_every: int,
    layers: int = 2,
    max_batch: int = 8,
    max_q: int = 16,
    max_prefix: int = 200,
    seed: int = 0,
    deadline: float | None = None,
) -> Series:
    """``cycles`` plan + ``layers`` runs of fresh random batches through ``provider``."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = pg.num_pages(max_q + max_prefix, config.page_size)
    num_pages = max_batch * pages_per + 8
    k, v = _caches(config, num_pages, gen, device)
    attn = PagedAttention(config, provider, device)
    qgen = torch.Generator(device).manual_seed(seed)  # queries drawn where they are used (up to 4096 x 32 x 128)
    probe = random_batch(
        torch.Generator().manual_seed(seed + 1), config, max_batch, max_q, max_prefix, num_pages, ForwardMode.EXTEND
    )
    s = Series(warmup, sample_every)
    for it in s.iterations(cycles, device, deadline):
        # the cycle before each sample runs one fixed batch: what is alive at a sample (its plan,
        # queries, outputs) is then the same every time, so the samples compare like with like
        sampled_next = (it + 1) % sample_every == 0 or it + 1 == cycles
        batch = probe if sampled_next else random_batch(gen, config, max_batch, max_q, max_prefix, num_pages)
        plan = attn.plan(batch, num_pages=num_pages)
        q = torch.randn(
            plan.num_tokens, config.num_qo_heads, config.head_dim, generator=qgen, device=device, dtype=config.dtype
        )
        out = torch.empty_like(q)
        for _ in range(layers):
            attn.run(q, k, v, out=out)
    return s


def soak_graph_replay(
    config: AttentionConfig,
    provider: str,
    device: torch.device,
    replays: int,
    warmup: int,
    sample_every: int,
    max_batch: int = 4,
    max_prefix: int = 120,
    seed: int = 1,
    deadline: float | None = None,
) -> Series:
    """``replays`` graph replays (decode): ``update`` / ``update_from_block_table`` + ``run`` (CUDA: replay)."""
    gen = torch.Generator().manual_seed(seed)
    P = config.page_size
    max_pages_per = pg.num_pages(max_prefix + 1, P)
    num_pages = max_batch * max_pages_per + 8
    k, v = _caches(config, num_pages, gen, device)
    gs = GraphState(
        config,
        provider,
        max_batch=max_batch,
        max_tokens=max_batch,
        max_pages=max_batch * max_pages_per,
        device=device,
        mode="decode",
        pad_page=num_pages - 1,
        max_seq_len=max_pages_per * P,
    )
    q = torch.randn(max_batch, config.num_qo_heads, config.head_dim, generator=gen).to(config.dtype).to(device)
    out = torch.empty_like(q)
    graphs = {}
    for bs in range(1, max_batch + 1):
        gs.prepare_capture(bs)
        if device.type == "cuda":
            gs.run(bs, q[:bs], k, v, out[:bs])  # warm the kernels outside capture
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gs.run(bs, q[:bs], k, v, out[:bs])
            graphs[bs] = g
    table = torch.zeros(max_batch, max_pages_per, dtype=torch.int32, device=device)
    s = Series(warmup, sample_every)
    for it in s.iterations(replays, device, deadline):
        bs = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
        B = int(torch.randint(1, bs + 1, (1,), generator=gen))
        batch = random_batch(gen, config, B, 1, max_prefix, num_pages - 1, ForwardMode.DECODE)
        B = batch.batch_size
        if it % 2:
            seq = (batch.kv_indptr[1:] - batch.kv_indptr[:-1] - 1) * P + batch.kv_last_page_len
            for b in range(B):
                pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
                table[b, : pages.numel()] = pages.to(device)
            gs.update_from_block_table(seq.to(device), table, bs, host_seq_lens=seq)
        else:
            gs.update(batch, bs)
        if device.type == "cuda":
            graphs[bs].replay()
        else:
            gs.run(bs, q[:bs], k, v, out[:bs])
    return s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m attnplug.bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--provider", default=None, help="plan/run provider (default: reference on CPU, triton on CUDA)")
    ap.add_argument("--graph-provider", default="triton", help="GraphState provider (must replay decode)")
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--replays", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--sample-every", type=int, default=250)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds per phase; stop early (0: none)")
    ap.add_argument("--phases", default="plan_run,graph_replay", help="comma-separated phases to run")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":  # the Triton interpreter: tiny shapes
        os.environ.setdefault("TRITON_INTERPRET", "1")
        config = AttentionConfig(4, 2, 32, 16, torch.float32)
        shapes = dict(
            plan_run=dict(layers=1, max_batch=4, max_q=8, max_prefix=64), graph_replay=dict(max_batch=4, max_prefix=64)
        )
    else:  # Llama-3-8B attention, batches of up to 64 requests
        config = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
        shapes = dict(
            plan_run=dict(layers=4, max_batch=64, max_q=16, max_prefix=4096),
            graph_replay=dict(max_batch=64, max_prefix=4096),
        )
    provider = args.provider or ("reference" if dev.type == "cpu" else "triton")
    tracemalloc.start()
    res = dict(
        what="memory after warm-up: growth = end - first sample after warm-up (bytes)",
        device=str(dev),
        config=str(config),
        torch=torch.__version__,
        python=platform.python_version(),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        phases={},
    )
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - {"plan_run", "graph_replay"}:
        ap.error(f"--phases takes plan_run and/or graph_replay, got {args.phases!r}")
    for name, fn, prov, n in (
        ("plan_run", soak_plan_run, provider, args.cycles),
        ("graph_replay", soak_graph_replay, args.graph_provider, args.replays),
    ):
        if name not in phases:
            continue
        t0 = time.time()
        deadline = t0 + args.time_budget if args.time_budget else None
        s = fn(config, prov, dev, n, args.warmup, args.sample_every, deadline=deadline, **shapes[name])
        summ = {
            "provider": prov,
            "requested": n,
            "seconds": round(time.time() - t0, 1),
            "shapes": shapes[name],
            **s.summary(),
            "series": {
                "iters": s.iters,
                "traced": s.traced,
                "traced_outside_triton": s.traced_outside_triton,
                "compiled": s.compiled,
                "rss": s.rss,
                "cuda_alloc": s.cuda_alloc,
                "cuda_reserved": s.cuda_reserved,
            },
        }
        res["phases"][name] = summ
        print(name, {k: v for k, v in summ.items() if k != "series"}, flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    if args.out:
        print("wrote", args.out)


if __name__ == "__main__":
    main()
