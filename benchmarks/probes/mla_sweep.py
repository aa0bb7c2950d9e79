"""The triton MLA decode kernel's launch knobs (issue 45: 0.25-0.55x the library kernels, unswept), one call:
each decode row of the bench (64x4096 and 1x32768, 16 and 128 heads, DeepSeek latent 512 + 64, page 64, bf16)
timed with the plan's defaults, then with ``block_n`` x ``num_warps`` x ``num_stages`` forced, the heads a
program (``block_m``, decode rows = heads) and the split count, against FA3's ``qv`` MLA call
(``fa3.mla_qv``, vLLM's FLASH_ATTN_MLA) in the same run; every variant checked against the float32
reference first (relative error <= 1e-2, no NaN), a failing one reported and skipped.

    bash scripts/gpu_run.sh python3 benchmarks/probes/mla_sweep.py --out $OUT/mla-sweep.json [--rows h16]
        [--grid "block_n=32,64 num_warps=8 num_stages=2 num_kv_splits=8,16,32,64"]   # combinations only
    python3 benchmarks/probes/mla_sweep.py --smoke   # CPU: one tiny row, two variants, no timing
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attnplug.bench import impls, mla  # noqa: E402, F401 (impls first: it imports mla)
from attnplug.bench.timing import bench_ms  # noqa: E402
from attnplug.bench.workloads import Row, rel_err  # noqa: E402
from attnplug.core import PagedAttention  # noqa: E402
from attnplug.core.plan import make_plan  # noqa: E402
from attnplug.core.reference import reference_attention  # noqa: E402

KNOBS = dict(block_n=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2, 3))


def rows(smoke: bool) -> list[Row]:
    if smoke:
        return [Row("MLA decode 2x200 h4", "decode", 2, 1, 199, mla=(4, 64, 16))]
    return [
        Row(f"MLA decode {b}x{n} h{h}", "decode", b, 1, n - 1, mla=(h, mla.RANK, mla.ROPE))
        for h in (16, 128)
        for b, n in ((64, 4096), (1, 32768))
    ]


def variants(work, smoke: bool) -> list[dict]:
    """The defaults, the knob grid, then heads a program and split counts around the default plan's."""
    if smoke:
        return [{}, dict(block_n=16, num_warps=4, num_stages=1)]
    out = [{}] + [dict(zip(KNOBS, v)) for v in itertools.product(*KNOBS.values())]
    h = work.config.num_qo_heads
    out += [dict(block_m=bm) for bm in (16, 32, 64) if bm <= h]
    attn = PagedAttention(work.config, "triton", work.q.device, cascade="off")
    s = attn.plan(work.batch, num_pages=work.num_pages).state.num_splits
    out += [dict(num_kv_splits=n) for n in sorted({1, max(1, s // 2), 2 * s, 4 * s} - {s})]
    return out


def grid(spec: str) -> list[dict]:
    """``--grid "block_n=32,64 num_kv_splits=16,32"``: the defaults, then every combination of the listed
    plan knobs (in place of :func:`variants`)."""
    axes = dict((k, [int(x) for x in v.split(",")]) for k, v in (a.split("=") for a in spec.split()))
    return [{}] + [dict(zip(axes, v)) for v in itertools.product(*axes.values())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--rows", help="substring a row's name must contain (e.g. h16, 1x32768)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny row, no timing")
    ap.add_argument("--grid", help='knob combinations in place of the sweep, e.g. "block_n=32,64 num_kv_splits=16,32"')
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    res = []
    for row in rows(args.smoke):
        if args.rows and args.rows not in row.name:
            continue
        work = mla.build_mla(row, dtype, dev)
        plan = make_plan(work.config, work.batch, work.num_pages, device=dev)
        ref, _ = reference_attention(plan, work.q.float(), work.k_cache, work.v_cache)
        anchor = None
        if not args.smoke:
            try:
                anchor = bench_ms(mla._fa3_mla(work), dev)
                res.append(dict(row=row.name, impl="fa3.mla_qv", ms=anchor))
            except Exception as e:  # noqa: BLE001 (no FA3: the ratios are left out)
                res.append(dict(row=row.name, impl="fa3.mla_qv", error=f"{type(e).__name__}: {e}"[:500]))
        for knobs in grid(args.grid) if args.grid else variants(work, args.smoke):
            r = dict(row=row.name, impl="attnplug.triton", knobs=knobs)
            try:
                attn = PagedAttention(work.config, "triton", dev, cascade="off")
                p = attn.plan(work.batch, num_pages=work.num_pages, **knobs)
                a = p.state
                r.update(block_h=a.block_h, block_n=a.block_n, warps=a.num_warps, stages=a.num_stages)
                r["splits"] = a.num_splits
                out = torch.empty(*work.q.shape[:2], work.config.head_dim_v, dtype=work.q.dtype, device=dev)
                fn = lambda attn=attn, out=out: attn.run(work.q, work.k_cache, work.v_cache, out=out)  # noqa: E731
                fn()
                r["rel_err"] = rel_err(out, ref)
                r["nan"] = bool((~torch.isfinite(out)).any())
                if not r["nan"] and r["rel_err"] <= 1e-2 and not args.smoke:
                    r["ms"] = bench_ms(fn, dev)
                    r["x_fa3"] = anchor / r["ms"] if anchor else None
                    r["gb_s"] = work.nbytes / r["ms"] / 1e6
            except Exception as e:  # noqa: BLE001 (one failing variant must not stop the sweep)
                traceback.print_exc()
                r["error"] = f"{type(e).__name__}: {e}"[:500]
            res.append(r)
            print(json.dumps(r, default=str), flush=True)
    best = {}
    for r in res:
        if r["impl"] == "attnplug.triton" and "ms" in r and (r["row"] not in best or r["ms"] < best[r["row"]]["ms"]):
            best[r["row"]] = r
    default = {r["row"]: r for r in res if r["impl"] == "attnplug.triton" and r.get("knobs") == {} and "ms" in r}
    print("\nrow | default ms (x fa3) | best ms (x fa3) | best knobs")
    for name, b in best.items():
        d = default.get(name, {})
        dx, bx = d.get("x_fa3") or 0, b.get("x_fa3") or 0
        print(f"{name} | {d.get('ms', 0):.4f} ({dx:.2f}) | {b['ms']:.4f} ({bx:.2f}) | {b['knobs']}")
    bad = [r for r in res if r["impl"] == "attnplug.triton" and (r.get("nan") or r.get("rel_err", 0) > 1e-2)]
    failed = [r for r in res if r["impl"] == "attnplug.triton" and "error" in r]
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=res, wrong=len(bad), failed=len(failed)), indent=1, default=str))
    print("wrong:", len(bad), "failed to run:", len(failed))
    sys.exit(1 if bad or (args.smoke and failed) else 0)  # on the GPU a variant may not fit: reported, not fatal


if __name__ == "__main__":
    main()
