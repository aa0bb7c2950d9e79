"""Host cost of planning one forward (issue 14): ``make_plan`` (validation + the provider-neutral plan,
shared by every provider) and ``PagedAttention.plan`` per provider, for 64 requests at page 16.

    python benchmarks/probes/plan_cost.py --tag after            # -> benchmarks/results/plan-cost-<device>-<tag>.json
    python benchmarks/probes/plan_cost.py --device cuda --tag h200  # on a GPU: every provider that is available
    # CPU: fa3's plan() too, over the tests' FA3 stand-in
    python benchmarks/probes/plan_cost.py --fa3-standin --tag now

Rows: ``make_plan``; ``plan[p]`` = ``PagedAttention(config, p).plan(batch, num_pages=...)`` (options,
``make_plan``, the shared-prefix (cascade) planner, the provider's ``plan``); ``plan[p, cascade off]``
the same with ``cascade="off"``; ``provider.plan[p]`` = the provider's ``plan`` alone on a plan
``make_plan`` built. Target (issue 14): ``make_plan`` + the triton
provider's ``plan`` <= 100 us for 64 requests.

Method: the batch metadata is host int32 tensors (what the engine adapters pass); each measured
callable runs ``--warmup`` times, then ``--calls`` times, each call timed alone with
``time.perf_counter_ns`` (host wall time of the call; on CUDA the plan's host->device copies are
included as the call issues them) and with ``time.thread_time_ns`` (CPU time of the calling thread:
the host work itself, without the time other processes of a shared machine took the core away).
Callables run in interleaved rounds (a burst of load hits all alike). Reported in microseconds: wall
median over all calls (the figure), the lowest round median, p10 / p90 / mean, the CPU-time median.
The machine is shared, so the median of many calls is the number to read; rerun for p90.

Workloads (Llama-3-8B attention: 32 q / 8 KV heads, d128, bf16, page 16; lengths random, seed 0):
  decode        64 requests, q 1, kv 256..4096
  extend        64 requests, q 512 after a cached prefix of 256..2048 (causal)
  verify_chain  64 requests, q 4 (1 + 3 draft tokens, causal chain: vLLM's spec decode), prefix 256..4096
  verify_tree   64 requests, q 4 with a random tree custom mask (SGLang EAGLE), prefix 256..2048
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from attnplug.bench.workloads import random_tree_mask  # noqa: E402
from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention, make_plan  # noqa: E402
from attnplug.core.providers import ProviderUnavailable, available_providers, provider_names  # noqa: E402

B, PAGE = 64, 16
CONFIG = AttentionConfig(32, 8, 128, PAGE, torch.bfloat16)


def workload(kind: str, seed: int = 0) -> tuple[BatchMetadata, int]:
    """Host metadata of one workload and the number of pages of its cache."""
    g = torch.Generator().manual_seed(seed)
    q_len, lo, hi, mode = {
        "decode": (1, 255, 4095, ForwardMode.DECODE),
        "extend": (512, 256, 2048, ForwardMode.EXTEND),
        "verify_chain": (4, 256, 4096, ForwardMode.TARGET_VERIFY),
        "verify_tree": (4, 256, 2048, ForwardMode.TARGET_VERIFY),
    }[kind]
    prefix = torch.randint(lo, hi + 1, (B,), generator=g)
    kv = prefix + q_len
    pages = (kv + PAGE - 1) // PAGE
    num_pages = int(pages.sum()) + 64
    kv_indices = torch.randperm(num_pages, generator=g)[: int(pages.sum())].to(torch.int32)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    last = ((kv - 1) % PAGE + 1).to(torch.int32)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32) * q_len
    mask = None
    if kind == "verify_tree":
        blocks = []
        for b in range(B):
            m = torch.ones(q_len, int(kv[b]), dtype=torch.bool)
            m[:, int(prefix[b]) :] = random_tree_mask(q_len, g)
            blocks.append(m.flatten())
        mask = torch.cat(blocks)
    return BatchMetadata(mode, qo_indptr, kv_indptr, kv_indices, last, custom_mask=mask), num_pages


def time_calls(fns: dict, warmup: int, calls: int, rounds: int = 10) -> dict:
    """Time each callable of ``fns`` ``calls`` times in ``rounds`` interleaved rounds (so a burst of
    load from other processes hits every callable alike). Per callable: the median over all calls,
    the lowest round median (the least disturbed round), p10 / p90 / mean, and the median CPU time of
    the calling thread, in microseconds."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    clock, tclock = time.perf_counter_ns, time.thread_time_ns
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    best = {k: float("inf") for k in fns}
    per = max(1, calls // rounds)
    for _ in range(rounds):
        for k, fn in fns.items():
            w = []
            for _ in range(per):
                t0, c0 = clock(), tclock()
                fn()
                c1, t1 = tclock(), clock()
                w.append(t1 - t0)
                cpu[k].append(c1 - c0)
            wall[k] += w
            best[k] = min(best[k], statistics.median(w) / 1e3)
    res = {}
    for k in fns:
        us = sorted(t / 1e3 for t in wall[k])
        q = lambda f: us[min(len(us) - 1, int(f * len(us)))]  # noqa: E731
        res[k] = dict(
            median_us=round(statistics.median(us), 2),
            best_round_median_us=round(best[k], 2),
            p10_us=round(q(0.1), 2),
            p90_us=round(q(0.9), 2),
            mean_us=round(statistics.fmean(us), 2),
            cpu_median_us=round(statistics.median(cpu[k]) / 1e3, 2),
            calls=len(us),
        )
    return res


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "attnplug/core"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return rev + ("+dirty(attnplug/core)" if dirty else "")
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--providers", default=None, help="comma list (default: every provider available on --device)")
    ap.add_argument("--workloads", default="decode,extend,verify_chain,verify_tree")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/plan-cost-<device>-<tag>.json)")
    ap.add_argument(
        "--fa3-standin",
        action="store_true",
        help="CPU: the fa3 provider's host side over the tests' FA3 stand-in (tests/core/fa3_standin.py)",
    )
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = torch.device(args.device)
    names = args.providers.split(",") if args.providers else available_providers(dev)
    if args.fa3_standin:  # plan() runs no FA3 kernel: the stand-in only lets the provider load
        import pytest  # noqa: PLC0415

        sys.path.insert(0, str(REPO / "tests" / "core"))
        import fa3_standin  # noqa: PLC0415

        fa3_standin.patch_fa3(pytest.MonkeyPatch())
        names = list(dict.fromkeys(names + ["fa3"]))
    res = dict(
        what="host time per plan call, 64 requests, page 16, 32/8 heads d128 bf16; median of --calls warm calls",
        device=str(dev),
        tag=args.tag,
        git=git_rev(),
        torch=torch.__version__,
        python=platform.python_version(),
        cpu=cpu_model(),
        cores=os.cpu_count(),
        load_avg_at_start=os.getloadavg(),
        unavailable=[n for n in provider_names() if n not in names],
        rows={},
        fa3="the tests' FA3 stand-in (host side only)" if args.fa3_standin else "as installed",
    )
    for kind in args.workloads.split(","):
        batch, num_pages = workload(kind)
        row = {
            "mask_elements": int(batch.custom_mask.numel()) if batch.custom_mask is not None else 0,
            "pages": int(batch.kv_indices.numel()),
            "tokens": int(batch.qo_indptr[-1]),
        }
        fns = {"make_plan": lambda: make_plan(CONFIG, batch, num_pages=num_pages, device=dev)}
        for name in names:
            try:
                attn = PagedAttention(CONFIG, name, dev)
            except (ProviderUnavailable, ValueError) as e:
                row[f"plan[{name}]"] = {"error": str(e)}
                continue
            p = make_plan(CONFIG, batch, num_pages=num_pages, device=dev)
            fns[f"plan[{name}]"] = lambda attn=attn: attn.plan(batch, num_pages=num_pages)
            fns[f"provider.plan[{name}]"] = lambda attn=attn, p=p: attn.provider.plan(p)
            if "cascade" in inspect.signature(PagedAttention).parameters:  # the shared-prefix planner's share
                off = PagedAttention(CONFIG, name, dev, cascade="off")
                fns[f"plan[{name}, cascade off]"] = lambda off=off: off.plan(batch, num_pages=num_pages)
        row.update(time_calls(fns, args.warmup, args.calls))
        if "provider.plan[triton]" in row:
            row["make_plan+provider.plan[triton]"] = {
                k: round(row["make_plan"][k] + row["provider.plan[triton]"][k], 2)
                for k in ("median_us", "best_round_median_us", "cpu_median_us")
            }
        res["rows"][kind] = row
        print(
            kind,
            {
                k: (v["median_us"], v["best_round_median_us"]) if isinstance(v, dict) and "median_us" in v else v
                for k, v in row.items()
            },
            flush=True,
        )
    out = Path(args.out or REPO / "benchmarks" / "results" / f"plan-cost-{dev.type}-{args.tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    res["load_avg_at_end"] = os.getloadavg()
    out.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
