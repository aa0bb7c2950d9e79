"""Plan knobs and tile entries of the triton decode (issues 14, 15): each row timed with one plan knob
forced (``--knob``, default ``num_kv_splits``; ``--values``, 0: the table's choice) and, optionally, a
tile entry put in force for the row's bucket (``--entry``: JSON, e.g. the decode kernel with a fused
merge), replayed from one CUDA graph (``attnplug.bench.timing``: median, L2 flushed), checked against
the float32 reference first.

    bash scripts/gpu_run.sh python3 benchmarks/probes/split_probe.py --rows 1x32768,4x32768 --splits 0,16,17,33 \\
        --entry '{"kernel": "decode", "block_n": 128, "num_warps": 4, "num_stages": 5, "fused_merge": true}' \\
        --out $OUT/split-probe.json
    # the fp8 full-batch entry's pipeline depth against batch size (stages-probe-h200-2026-12-04.json)
    bash scripts/gpu_run.sh python3 benchmarks/probes/split_probe.py --fp8 --knob num_stages --values 5,6,7 \\
        --rows 32x2048,64x2048,128x2048,256x1024,32x4096,64x4096,96x4096,128x4096,24x8192,48x8192 \\
        --out $OUT/stages.json"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attnplug.bench.timing import bench_ms, graphed  # noqa: E402
from attnplug.bench.workloads import FULL_CONFIG, Row, build, reference, rel_err  # noqa: E402
from attnplug.core import AttentionConfig, PagedAttention  # noqa: E402
from attnplug.core.kernels import tiles  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1x32768,4x32768")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument(
        "--knob", default="num_kv_splits", help="the PlanOptions knob forced (num_kv_splits, num_stages, ...)"
    )
    ap.add_argument("--values", "--splits", default="0,8,16,17,24,32,33", help="its values (0: the table's choice)")
    ap.add_argument("--entry", action="append", default=[], help="JSON tile entry for the rows' bucket (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = AttentionConfig(**FULL_CONFIG)
    entries = [None] + [json.loads(e) for e in args.entry]
    res = []
    for shape in args.rows.split(","):
        b, kv = (int(x) for x in shape.split("x"))
        row = Row(
            f"decode {shape}" + (" fp8" if args.fp8 else ""), "decode", b, 1, kv - 1, kv="fp8" if args.fp8 else ""
        )
        work = build(row, cfg, dev)
        sc = work.extra.get("scales", {})
        out = torch.empty_like(work.q)
        t = int(work.batch.qo_indptr[min(4, b)])
        ref = reference(work, min(4, b))
        for entry in entries:
            saved = dict(tiles.TILES)
            try:
                attn = PagedAttention(work.config, "triton", dev)
                bucket = attn.provider._decode_bucket(b * cfg.num_kv_heads)
                if entry is not None:
                    tiles.TILES[tiles.key(cfg.head_dim, cfg.group_size, bucket, fp8=args.fp8)] = entry
                line = {"row": row.name, "bucket": bucket, "entry": entry or "table"}
                label = "splits" if args.knob == "num_kv_splits" else args.knob
                for s in (int(x) for x in args.values.split(",")):
                    plan = attn.plan(work.batch, num_pages=work.num_pages, **({args.knob: s} if s else {}))
                    fn = lambda w=work: attn.run(w.q, w.k_cache, w.v_cache, out=out, **sc)  # noqa: E731
                    fn()
                    err = rel_err(out[:t], ref)
                    ms = bench_ms(graphed(fn, dev), dev) if err <= 2e-2 else float("nan")
                    line[f"{label}={s or 'rule'}"] = (round(ms, 5), plan.state.num_splits, plan.state.kernel)
                res.append(line)
                print(line, flush=True)
            finally:
                tiles.TILES.clear()
                tiles.TILES.update(saved)
        del work
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(rows=res), indent=1) + "\n")


if __name__ == "__main__":
    main()
