"""The Gluon prefill kernel (issue 46) on the H200, one quick call: correctness, then TFLOP/s against
fa3.paged and the Triton prefill kernel, page 16, bf16, the bench's shapes (``attnplug.bench.workloads``:
random permuted page tables).

    bash scripts/gpu_run.sh python benchmarks/probes/gluon_prefill_probe.py [--out F.json] [--rows d128]

1. Correctness: the triton provider (Gluon plan) against the float32 reference on small ragged prefill /
   extend batches at d64 / d128 / d256 (relative L2 error, NaN check, max LSE error).
2. Speed: rows ``prefill 4x4096``, ``prefill 1x8192``, ``extend 8x(512+4096)`` at d128 (32/8 heads), and the
   prefill 4x4096 row at d64 (32/8) and d256 (16/8): ``attnplug.triton`` with the Gluon kernel, the same
   provider with Gluon off (the Triton kernel), ``fa3.paged`` (FA3 called directly), medians of CUDA-event
   timings (``attnplug.bench.timing.bench_ms``), plus each one's relative error against FA3's output.

3. Sweep (``--no-sweep`` skips it): the first row of each head dim again with other Gluon configurations
   (``gluon_prefill.CONFIGS`` entries: block_m, block_n, stages, warps, qk_ahead, loaders, pingpong; the
   warp-specialized kernel where loaders > 0), to pick the table's.

Every configuration runs on its own: a compile error or a failure prints its traceback and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "core"))

from attnplug.bench import impls, workloads  # noqa: E402
from attnplug.bench.timing import bench_ms  # noqa: E402
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention  # noqa: E402
from attnplug.core.kernels import gluon_prefill  # noqa: E402
from attnplug.core.plan import make_plan  # noqa: E402

os.environ.setdefault("ATTNPLUG_GLUON", "1")  # the probe measures the Gluon kernel (on by default)
from batches import random_case, rel_err  # noqa: E402

from attnplug.core.providers.triton import gluon_sm90  # noqa: E402
from attnplug.core.reference import reference_attention  # noqa: E402

CHECKS = {  # name -> ((Hq, Hkv, D), q lens, prefix lens)
    "d128 prefill": ((32, 8, 128), [300, 17, 129, 1000], [0, 0, 0, 0]),
    "d128 extend": ((32, 8, 128), [200, 37, 513, 1], [1000, 0, 77, 4000]),
    "d128 mha": ((8, 8, 128), [257, 64], [0, 300]),
    "d128 group8": ((64, 8, 128), [257, 64], [0, 300]),
    "d64 extend": ((32, 8, 64), [300, 129], [50, 0]),
    "d256 extend": ((16, 8, 256), [300, 129], [50, 0]),
}
ROWS = [  # (tag, Row)
    ("d128", workloads.Row("prefill 4x4096", "prefill", 4, 4096, 0)),
    ("d128", workloads.Row("prefill 1x8192", "prefill", 1, 8192, 0)),
    ("d128", workloads.Row("extend 8x(512+4096)", "prefill", 8, 512, 4096)),
    ("d64", workloads.Row("prefill 4x4096 d64", "prefill", 4, 4096, 0, heads=(32, 8, 64))),
    ("d256", workloads.Row("prefill 4x4096 d256", "prefill", 4, 4096, 0, heads=(16, 8, 256))),
]

# head_dim -> the configurations to time on the tag's first row besides the table's (block_m, block_n, stages, warps,
# qk_ahead, loaders, pingpong): the single-partition kernel's, then every warp-specialized candidate
SWEEP = {
    d: [
        c
        for c in [gluon_prefill.SINGLE_PARTITION[d], *gluon_prefill.WS_CANDIDATES[d]]
        if c != gluon_prefill.CONFIGS.get(d)
    ]
    for d in gluon_prefill.SINGLE_PARTITION
}


def triton_attn(config, gluon: bool) -> PagedAttention:
    attn = PagedAttention(config, "triton", "cuda")
    attn.provider._gluon = gluon and gluon_sm90(attn.device)  # the instance is shared: set, never inherited
    return attn


def check(name, heads, q_lens, prefix) -> dict:
    config = AttentionConfig(*heads, 16, torch.bfloat16)
    case = random_case(ForwardMode.EXTEND, q_lens, prefix, config, "cuda", seed=1)
    attn = triton_attn(config, True)
    plan = attn.plan(case.batch, num_pages=case.num_pages)
    out = torch.full_like(case.q, math.nan)
    lse = torch.full(case.q.shape[:2], math.nan, device="cuda")
    t0 = time.perf_counter()
    attn.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0  # compile + run
    whole = make_plan(config, case.batch, case.num_pages, device="cuda")
    ref, ref_lse = reference_attention(whole, case.q.float(), case.k_cache, case.v_cache)
    r = dict(
        check=name,
        kernel=plan.state.kernel,
        rel_err=rel_err(out, ref),
        nan=bool((~torch.isfinite(out)).any()),
        lse_max_err=float((lse - ref_lse).abs().max()),
        first_run_s=round(first_s, 2),
    )
    r["expected"] = "gluon" if config.head_dim in gluon_prefill.CONFIGS else "prefill"  # the table's head dims
    r["ok"] = r["kernel"] == r["expected"] and not r["nan"] and r["rel_err"] <= 1e-2 and r["lse_max_err"] < 2e-2
    return r


def bench_row(tag, row, sweep: bool) -> list[dict]:
    work = workloads.build(row, AttentionConfig(**workloads.FULL_CONFIG), torch.device("cuda"))
    d = work.config.head_dim
    results, outs = [], {}
    runs = [("attnplug.triton.gluon", True, None), ("attnplug.triton.nogluon", False, None), ("fa3.paged", None, None)]
    runs += [(f"attnplug.triton.gluon.sweep{list(c)}", True, c) for c in (SWEEP.get(d, []) if sweep else [])]
    product = gluon_prefill.CONFIGS.get(d)
    for label, gluon, cfg in runs:
        try:
            if cfg is not None:  # planned with this configuration in the table
                gluon_prefill.CONFIGS[d] = cfg
            if gluon is None:
                fn = impls._fa3_direct(work)
                out = fn()
            else:
                attn = triton_attn(work.config, gluon)
                plan = attn.plan(work.batch, num_pages=work.num_pages)
                out = torch.empty_like(work.q)
                fn = lambda attn=attn, out=out: attn.run(work.q, work.k_cache, work.v_cache, out=out)  # noqa
                fn()
                label += f"[{plan.state.kernel}]"
            torch.cuda.synchronize()
            ms = bench_ms(fn, torch.device("cuda"))
            outs[label] = (out[0] if isinstance(out, tuple) else out).float()
            results.append(dict(row=row.name, tag=tag, impl=label, ms=ms, tflops=work.flops / ms / 1e9))
        except Exception as e:  # noqa: BLE001 (one failing impl must not stop the others)
            traceback.print_exc()
            results.append(dict(row=row.name, tag=tag, impl=label, error=f"{type(e).__name__}: {e}"[:2000]))
        finally:
            if product is None:
                gluon_prefill.CONFIGS.pop(d, None)
            else:
                gluon_prefill.CONFIGS[d] = product
    fa3 = next((o for k, o in outs.items() if k.startswith("fa3")), None)
    for r in results:
        if fa3 is not None and r["impl"] in outs and not r["impl"].startswith("fa3"):
            r["rel_err_vs_fa3"] = rel_err(outs[r["impl"]], fa3)
    f = next((r["tflops"] for r in results if r["impl"].startswith("fa3") and "tflops" in r), None)
    for r in results:
        if f and "tflops" in r:
            r["x_fa3"] = r["tflops"] / f
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--rows", nargs="*", help="row tags to time (d64 d128 d256; default all)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="skip the configuration sweep")
    args = ap.parse_args()
    import triton

    dev = torch.device("cuda")
    print(
        f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} "
        f"sm{''.join(map(str, torch.cuda.get_device_capability()))} gluon_sm90={gluon_sm90(dev)}",
        flush=True,
    )
    res = {
        "env": dict(
            torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(), gluon=gluon_sm90(dev)
        ),
        "checks": [],
        "rows": [],
    }
    if not args.no_check:
        for name, (heads, q_lens, prefix) in CHECKS.items():
            try:
                r = check(name, heads, q_lens, prefix)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                r = dict(check=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            res["checks"].append(r)
            print("CHECK", json.dumps(r), flush=True)
    swept = set()
    for tag, row in ROWS:
        if args.rows and tag not in args.rows:
            continue
        for r in bench_row(tag, row, not args.no_sweep and tag not in swept):
            res["rows"].append(r)
            print("ROW", json.dumps(r), flush=True)
        swept.add(tag)
    print("\nrow | impl | ms | TFLOP/s | x fa3 | rel err vs fa3")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['row']} | {r['impl']} | ERROR {r['error'][:200]}")
        else:
            wrong = "  <-- WRONG (> 1e-2)" if r.get("rel_err_vs_fa3", 0.0) > 1e-2 else ""
            print(
                f"{r['row']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                f"{r.get('x_fa3', math.nan):.2f} | {r.get('rel_err_vs_fa3', math.nan):.2e}{wrong}"
            )
    bad = [c["check"] for c in res["checks"] if not c.get("ok")]
    bad += [
        f"{r['row']}: {r['impl']}"
        for r in res["rows"]  # the table's configuration: Gluon where the table has the head dim, right
        if r["impl"].startswith("attnplug.triton.gluon")
        and ".sweep" not in r["impl"]
        and (
            "error" in r
            or ("[gluon]" in r["impl"]) != (r["tag"] in {f"d{d}" for d in gluon_prefill.CONFIGS})
            or not r.get("rel_err_vs_fa3", 0.0) <= 1e-2
        )
    ]
    print("checks:", "all ok" if not bad else f"FAILED {bad}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
