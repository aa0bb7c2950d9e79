"""Cascade decode graphs on by default (issue 43): what they cost where nothing is shared and what they
save where a prompt is shared, per provider, as graph replays of one layer's attention.

    python benchmarks/probes/cascade_unshared_bench.py [--providers triton,fa3,flashinfer] [--out F.json]
    python benchmarks/probes/cascade_unshared_bench.py --smoke      # CPU (Triton interpreter), 2 tiny rows

Llama-3-8B attention (32/8 heads, d 128, page 16, bf16). Unshared rows: ``m`` requests x ``ctx`` tokens (2..64
x 1024..8192), no page in common; the shared row: 64 x (8192 shared + 256 own). Each row: a decode
``GraphState`` with ``cascade="auto"`` (the default) and one with ``"off"`` (``ATTNPLUG_CASCADE_GRAPHS=0``),
both sized as an engine sizes its graph families (``--max-batch``, default 256: captured at ``m`` within a family
of up to 256 requests) and updated from the device block table as the engines do, checked against the float32 reference,
captured alone and timed as replays (CUDA events, median of ``--reps``), the two interleaved. Printed per
row: off / on us a layer, the extra (unshared: must be <= max(1%, 1.5 us)) or the speed-up (shared: >= 3.9x).
A provider whose graphs cannot run cascade prints ``n/a``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cascade_graph_bench import captured  # noqa: E402

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch  # noqa: E402
from attnplug.core import AttentionConfig, ForwardMode, ProviderUnavailable  # noqa: E402
from attnplug.core.cuda_graph import GraphState  # noqa: E402
from attnplug.core.plan import make_plan  # noqa: E402
from attnplug.core.providers import get_provider_cls  # noqa: E402
from attnplug.core.reference import reference_attention  # noqa: E402

SIZES = (2, 4, 8, 16, 32, 64)
CTXS = (1024, 2048, 4096, 8192)


def block_table(batch) -> torch.Tensor:
    """The batch's pages as the engines hand them over: ``block_table [B, W]`` int32."""
    ind = batch.kv_indptr
    counts = ind[1:] - ind[:-1]
    table = torch.zeros(batch.batch_size, int(counts.max()), dtype=torch.int32)
    for b in range(batch.batch_size):
        table[b, : int(counts[b])] = batch.kv_indices[int(ind[b]) : int(ind[b + 1])]
    return table


def replay_pair(gss, B, q, k, v, dev, reps):
    """Median replay ms of each graph state's ``run``, captured alone, the two timed interleaved."""
    outs, graphs = [], []
    for gs in gss:
        out = torch.empty_like(q)
        graphs.append(captured(gs, B, q, k, v, out, dev).replay)
        outs.append(out)
    if dev.type != "cuda":
        for r in graphs:
            r()
        return outs, [float("nan")] * len(gss)
    times = [[] for _ in gss]
    for r in graphs:
        for _ in range(10):
            r()
    torch.cuda.synchronize()
    for _ in range(reps):
        for i, r in enumerate(graphs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            r()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b))
    return outs, [sorted(t)[len(t) // 2] for t in times]


def workload(cfg, spec, own, dev):
    """A decode batch over the engine-style layout of ``prompts(spec, own)`` and its float32 reference."""
    batch, q, k, v, num_pages = shared_prefix_batch(cfg, ForwardMode.DECODE, prompts(spec, own), device=dev)
    ref, _ = reference_attention(make_plan(cfg, batch, num_pages, device=dev), q, k, v)
    return batch, q, k, v, num_pages, ref


def row(cfg, work, provider, dev, reps, on="auto", max_batch=0) -> dict:
    batch, q, k, v, num_pages, ref = work
    B, P = batch.batch_size, cfg.page_size
    ind = batch.kv_indptr
    seq = ((ind[1:] - ind[:-1] - 1) * P + batch.kv_last_page_len).to(torch.int32).to(dev)
    table = block_table(batch).to(dev)
    max_seq = int(table.shape[1]) * P
    gss = []
    for mode in ("off", on):
        gs = GraphState(
            cfg,
            provider,
            max_batch=max(B, max_batch),
            max_tokens=max(B, max_batch),
            max_pages=num_pages,
            device=dev,
            pad_page=num_pages - 1,
            max_seq_len=max_seq,
            cascade=mode,
        )
        gs.prepare_capture(B)
        gs.update_from_block_table(seq, table, B, host_seq_lens=seq.cpu() if gs.needs_host_lengths else None)
        gss.append(gs)
    outs, (off, on) = replay_pair(gss, B, q, k, v, dev, reps)
    errs = [float((o.float() - ref.float()).norm() / ref.float().norm()) for o in outs]
    shared = int(gss[1].cascade.kv_lens.sum()) // P
    return dict(off_us=off * 1e3, on_us=on * 1e3, rel_err=max(errs), shared_pages=shared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="triton,fa3,flashinfer")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--max-batch", type=int, default=256, help="the graph families' largest batch (0: each row's own)")
    ap.add_argument("--out", default=None, help="JSON of every row")
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 tiny rows, no timing (checks the reference)")
    a = ap.parse_args()
    on = "always" if a.smoke else "auto"  # the smoke's tiny prefix is below the cost model's bound
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev, cfg = torch.device("cpu"), AttentionConfig(8, 2, 32, 16, torch.bfloat16)
        shapes, shared_spec = [(2, 64)], ([(3, 64)], 8)
    else:
        dev, cfg = torch.device("cuda"), AttentionConfig(32, 8, 128, 16, torch.bfloat16)
        shapes, shared_spec = [(m, c) for c in CTXS for m in SIZES], ([(64, 8192)], 256)
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "max_batch": a.max_batch,
        "rows": {},
    }
    print(f"{'provider':10} {'row':28} {'off us':>8} {'on us':>8} {'extra':>14}  verdict")
    providers = []
    for p in [x for x in a.providers.split(",") if x]:
        try:
            get_provider_cls(p).check_available(dev)
        except ProviderUnavailable as e:
            print(f"{p:10} n/a: {str(e)[:100]}")
            continue
        if get_provider_cls(p).graph_support.cascade:
            providers.append(p)
        else:
            print(f"{p:10} n/a: its graphs replay without cascade")
    for m, c in shapes:  # m groups of one request: c - own "prefix" tokens of its own + own more
        own = min(256, c // 4)
        work = workload(cfg, [(1, c - own)] * m, own, dev)
        for p in providers:
            r = row(cfg, work, p, dev, a.reps, on, 0 if a.smoke else a.max_batch)
            extra = r["on_us"] - r["off_us"]
            limit = max(0.01 * r["off_us"], 1.5)
            ok = "ok" if extra <= limit else f"OVER (limit {limit:.2f} us)"
            print(
                f"{p:10} {f'{m}x{c} unshared':28} {r['off_us']:8.2f} {r['on_us']:8.2f} "
                f"{extra:+7.2f} us {100 * extra / r['off_us']:+5.1f}%  {ok}  err {r['rel_err']:.1e}",
                flush=True,
            )
            res["rows"][f"{p} {m}x{c} unshared"] = r
        del work
    spec, own = shared_spec
    work = workload(cfg, spec, own, dev)
    for p in providers:
        r = row(cfg, work, p, dev, a.reps, on, 0 if a.smoke else a.max_batch)
        speed = r["off_us"] / r["on_us"]
        name = f"{spec[0][0]}x({spec[0][1]}+{own}) shared"
        print(
            f"{p:10} {name:28} {r['off_us']:8.2f} {r['on_us']:8.2f} {speed:10.2f}x     "
            f"{'ok' if speed >= 3.9 else 'UNDER 3.9x'}  err {r['rel_err']:.1e}  shared pages {r['shared_pages']}",
            flush=True,
        )
        res["rows"][f"{p} {name}"] = r
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
