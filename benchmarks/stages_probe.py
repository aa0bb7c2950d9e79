"""Pipeline depth of the triton fp8 full-batch decode entry (``d128/g4/decode/fp8``: 32-key blocks, one
warp, byte pairs) against batch size and context length: each row timed with ``num_stages`` forced
through the plan's knobs, replayed from one CUDA graph (``attnplug.bench.timing``: median, L2 flushed).
Says whether a depth that wins at one batch shape loses at another by the number of programs
(``B * Hkv``) or by the keys each program reads.

    bash scripts/gpu_run.sh python3 benchmarks/stages_probe.py --out $OUT/stages-probe.json"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnplug.bench.timing import bench_ms, graphed  # noqa: E402
from attnplug.bench.workloads import FULL_CONFIG, Row, build, reference, rel_err  # noqa: E402
from attnplug.core import AttentionConfig, PagedAttention  # noqa: E402

SHAPES = "32x2048,64x2048,128x2048,256x1024,32x4096,64x4096,96x4096,128x4096,24x8192,48x8192"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--stages", default="5,6,7")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = AttentionConfig(**FULL_CONFIG)
    res = []
    for shape in args.shapes.split(","):
        b, kv = (int(x) for x in shape.split("x"))
        row = Row(f"decode {shape} fp8", "decode", b, 1, kv - 1, kv="fp8")
        work = build(row, cfg, dev)
        attn = PagedAttention(work.config, "triton", dev)
        sc = work.extra["scales"]
        out = torch.empty_like(work.q)
        t = int(work.batch.qo_indptr[min(4, b)])
        ref = reference(work, min(4, b))
        line = {"row": row.name, "programs": b * cfg.num_kv_heads}
        for st in (int(s) for s in args.stages.split(",")):
            attn.plan(work.batch, num_pages=work.num_pages, num_stages=st)
            fn = lambda: attn.run(work.q, work.k_cache, work.v_cache, out=out, **sc)  # noqa: E731
            fn()
            err = rel_err(out[:t], ref)
            line[f"ms@{st}"] = round(bench_ms(graphed(fn, dev), dev), 5) if err <= 2e-2 else float("nan")
        res.append(line)
        print(line, flush=True)
        del work, attn
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(entry="d128/g4/decode/fp8 with num_stages forced", rows=res), indent=1) + "\n")


if __name__ == "__main__":
    main()
