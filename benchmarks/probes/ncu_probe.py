"""One forward of a benchmark row under Nsight Compute (GPU): where the triton provider's decode time goes.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python3 benchmarks/probes/ncu_probe.py --row "decode 64x4096 fp8" [--cascade auto] [--entry KEY=JSON]

The row is built as ``python -m attnplug.bench`` builds it (Llama-3-8B attention, page 16), planned by
the triton provider (cascade off unless ``--cascade``; ``--entry`` puts one tile-table entry in force),
run three times un-profiled (compiles, warms the caches), then once between ``cudaProfilerStart`` and
``cudaProfilerStop``: ncu profiles exactly the kernels of that forward (``--profile-from-start off``).
``--check`` compares that forward's output with the float32 reference of its first requests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", required=True, help="a row name of attnplug.bench.workloads.FULL_ROWS")
    ap.add_argument("--provider", default="triton")
    ap.add_argument("--cascade", default="off", help="PagedAttention's cascade mode (off / auto / always)")
    ap.add_argument("--entry", action="append", default=[], help="KEY=JSON: a tile-table entry in force")
    ap.add_argument("--check", action="store_true", help="compare the output with the float32 reference")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: the quick rows, Triton interpreter")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"

    import torch

    from attnplug.bench import impls, workloads
    from attnplug.core import AttentionConfig, PagedAttention
    from attnplug.core.kernels import tiles

    rows, config = (
        (workloads.QUICK_ROWS, workloads.QUICK_CONFIG) if a.smoke else (workloads.FULL_ROWS, workloads.FULL_CONFIG)
    )
    row = next((r for r in rows if r.name == a.row), None)
    if row is None:
        ap.error(f"no row {a.row!r}; rows: {[r.name for r in rows]}")
    for e in a.entry:
        k, _, v = e.partition("=")
        tiles.TILES[k] = json.loads(v)
    dev = torch.device("cpu" if a.smoke else "cuda")
    work = workloads.build(row, AttentionConfig(**config), dev)
    attn = PagedAttention(work.config, a.provider, dev, cascade=a.cascade)
    plan = attn.plan(work.batch, num_pages=work.num_pages)
    kw = impls.engine_scales(work)  # fp8 rows: the scales as the adapters pass them
    out = torch.empty_like(work.q)

    def fwd():
        attn.run(work.q, work.k_cache, work.v_cache, out=out, **kw)

    for _ in range(3):
        fwd()
    if a.smoke:
        fwd()
    else:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    state = plan.state
    print(
        f"ncu_probe: {a.row} provider {a.provider} cascade {plan.cascade is not None} "
        f"kernel {getattr(state, 'kernel', '?')} splits {getattr(state, 'num_splits', '?')} "
        f"block_n {getattr(state, 'block_n', '?')} bytes {work.nbytes}",
        flush=True,
    )
    if a.check:
        ref = workloads.reference(work, workloads.ref_requests(row))
        err = workloads.rel_err(out[: ref.shape[0]], ref)
        print(f"ncu_probe: rel err {err:.2e}", flush=True)
        if not err <= 2e-2:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
