"""KV layout and the triton decode kernel's reads (issue 15): the decode rows with the cache in ``NHD``
(``[pages, P, Hkv, D]``: one head's 16 keys of a page are 16 reads of D bytes (fp8) 1 KB apart) and
in ``HND`` (``[pages, Hkv, P, D]``: the same keys are one contiguous read of P * D bytes), bf16 and fp8,
each the triton provider replayed from one CUDA graph (``attnplug.bench.timing``: median, L2 flushed).

    bash scripts/gpu_run.sh python3 benchmarks/probes/layout_probe.py --out $OUT/layout-probe.json

Prints per row: ms in each layout, HND / NHD, fp8 / bf16 in each layout, and the relative error of the
first requests against the float32 reference (checked before timing)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attnplug.bench.timing import bench_ms, graphed  # noqa: E402
from attnplug.bench.workloads import FULL_CONFIG, FULL_ROWS, Row, build, ref_requests, reference, rel_err  # noqa: E402
from attnplug.core import AttentionConfig, PagedAttention  # noqa: E402

NAMES = ["decode 64x4096", "decode 1x32768", "decode 4x32768", "decode 128x2048"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default=",".join(NAMES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = {r.name: r for r in FULL_ROWS}
    res = []
    for name in args.rows.split(","):
        b, kv_len = (int(x) for x in name.split()[1].split("x"))
        base = rows.get(name) or Row(name, "decode", b, 1, kv_len - 1)
        for kv in ("", "fp8"):
            row = dataclasses.replace(base, name=base.name + (" fp8" if kv else ""), kv=kv)
            for layout in ("NHD", "HND"):
                cfg = AttentionConfig(**FULL_CONFIG, kv_layout=layout)
                work = build(row, cfg, dev)
                attn = PagedAttention(work.config, "triton", dev)
                attn.plan(work.batch, num_pages=work.num_pages)
                sc = work.extra.get("scales", {})
                out = torch.empty_like(work.q)
                fn = lambda a=attn, w=work: a.run(w.q, w.k_cache, w.v_cache, out=out, **sc)  # noqa: E731
                fn()
                nb = min(ref_requests(row), row.batch)
                t = int(work.batch.qo_indptr[nb])
                err = rel_err(out[:t], reference(work, nb))
                ms = bench_ms(graphed(fn, dev), dev) if err <= 2e-2 else float("nan")
                res.append(
                    dict(row=row.name, layout=layout, ms=round(ms, 5), err=err, GBps=round(work.nbytes / ms / 1e6))
                )
                print(
                    f"{row.name:22s} {layout}  {ms:.4f} ms  {work.nbytes / ms / 1e6:5.0f} GB/s  err {err:.1e}",
                    flush=True,
                )
                del work, attn
                torch.cuda.empty_cache() if dev.type == "cuda" else None
    get = {(r["row"], r["layout"]): r["ms"] for r in res}
    summary = []
    for name in args.rows.split(","):
        for layout in ("NHD", "HND"):
            summary.append(
                dict(
                    row=name, layout=layout, fp8_over_bf16=round(get[(name + " fp8", layout)] / get[(name, layout)], 4)
                )
            )
        for kv in ("", " fp8"):
            summary.append(
                dict(row=name + kv, hnd_over_nhd=round(get[(name + kv, "HND")] / get[(name + kv, "NHD")], 4))
            )
    for s in summary:
        print(s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", rows=res, summary=summary),
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
