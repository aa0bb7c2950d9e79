"""What a cascade decode graph costs on a batch that shares nothing (issue 13): the parts captured alone.

    python benchmarks/probes/cascade_unshared_probe.py [--providers triton,fa3] [--out F.json]

On the bench's shared-prefix row and its unshared twin (64 x (8192 + 256), Llama-3-8B attention, page 16),
a decode ``GraphState`` updated from the device block table as in the engines, each part captured in a
graph of its own and timed as replays (``triton.testing.do_bench``, median, L2 flushed):
``off`` (the graph without cascade), ``full`` (with cascade), ``suffix`` (the suffix plan alone, with its
LSE output; ``suffix_no_lse``: without), ``prefix`` (the prefix part alone: its kernel(s) and the merge
into the suffix state). fa3 also: ``fa3_call`` / ``fa3_call_lse`` (the suffix plan's FA3 call alone, the LSE
not asked / asked and not copied) and ``fa3_call_lse_copy`` (asked and copied ``[Hq, T] -> [T, Hq]``, as
the provider's ``run`` does): where the suffix's LSE costs.
triton on sm90 also ``full_no_trigger`` (the suffix's paged kernel without ``gdc_launch_dependents``) and
``full_no_pdl`` (no programmatic dependent launch, :mod:`attnplug.core.kernels.pdl`).
``full - off`` is what cascade costs (unshared) or saves (shared); ``prefix`` is the empty prefix
part's share of it on the unshared row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from sweep_cascade_prefix import graph_ms  # noqa: E402
from sweep_triton import bench_ms  # noqa: E402

from attnplug.bench.workloads import FULL_ROWS, build  # noqa: E402
from attnplug.core import AttentionConfig  # noqa: E402
from attnplug.core.cuda_graph import GraphState  # noqa: E402

CFG = AttentionConfig(32, 8, 128, 16, torch.bfloat16)


def graphed(fn) -> float:
    """ms of ``fn`` captured alone in a CUDA graph, replayed (``triton.testing.do_bench``, median)."""
    return graph_ms(fn, torch.device("cuda"), bench_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="triton,fa3")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    res = {}
    for row in [r for r in FULL_ROWS if r.name in ("cascade decode 64x(8192+256)", "decode 64x(8192+256) unshared")]:
        work = build(row, CFG, dev)
        q, k, v, B = work.q, work.k_cache, work.v_cache, work.batch.batch_size
        for p in a.providers.split(","):
            t = {}
            for mode in ("off", "auto"):
                gs = GraphState(
                    CFG,
                    p,
                    max_batch=B,
                    max_tokens=B,
                    max_pages=work.num_pages,
                    device=dev,
                    max_seq_len=work.block_table.shape[1] * CFG.page_size,
                    cascade=mode,
                )
                gs.prepare_capture(B)
                gs.update_from_block_table(work.seq_lens, work.block_table, B)
                out = torch.empty_like(q)
                t["off" if mode == "off" else "full"] = graphed(lambda: gs.run(B, q, k, v, out))
                if mode == "auto":
                    c = gs.cascade
                    s_lse = c.lse_suffix[:B]
                    t["shared_pages"] = int(c.kv_lens) // CFG.page_size
                    t["suffix"] = graphed(lambda: gs.provider.run(gs.plans[B], q, k, v, out, s_lse))
                    t["suffix_no_lse"] = graphed(lambda: gs.provider.run(gs.plans[B], q, k, v, out))
                    if hasattr(gs.provider, "lib"):  # fa3: its library call alone
                        fa = vars(gs.plans[B].state.args)
                        call = lambda r: gs.provider.lib.paged(q, k, v, out, return_lse=r, **fa)  # noqa: E731
                        t["fa3_call"] = graphed(lambda: call(False))
                        t["fa3_call_lse"] = graphed(lambda: call(True))
                        t["fa3_call_lse_copy"] = graphed(lambda: s_lse.copy_(call(True).t()))
                    t["prefix"] = graphed(
                        lambda: c.provider.run_merge(c.plans[B], q, k, v, out, s_lse, c.out_part[:B], c.lse_part[:B])
                    )
                    if getattr(c.provider, "_pdl_ok", None):  # triton on sm90: without PDL (same run)
                        gs.provider._pdl_ok = False
                        t["full_no_trigger"] = graphed(lambda: gs.run(B, q, k, v, out))
                        c.provider._pdl_ok = False
                        t["full_no_pdl"] = graphed(lambda: gs.run(B, q, k, v, out))
                        gs.provider._pdl_ok = c.provider._pdl_ok = None
            t = {x: (round(y * 1e3, 2) if isinstance(y, float) else y) for x, y in t.items()}  # us
            res[f"{row.name} | {p}"] = t
            print(f"{row.name:32s} {p:7s} " + "  ".join(f"{x} {y}" for x, y in t.items()) + "  (us)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
