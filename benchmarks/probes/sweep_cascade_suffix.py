"""Offline probe of the triton provider's ``decode`` tile entry as the cascade's suffix part runs it (issue 13):
CUDA-graph replays, the graph captured for the whole context (as in the engines), so the entry and the
split count are the capture's, whatever the replayed lengths.

    python benchmarks/probes/sweep_cascade_suffix.py --out DIR.jsonl      # GPU, ~2-3 min

Rows (Llama-3-8B attention, page 16, bf16): ``cascade decode 64x(8192+256)`` with cascade graphs (``full``:
the graph; ``suffix``: the suffix plan alone, 64 x ~257 keys), and the decode rows every replayed decode
graph shares the entry with (``decode 64x4096``, ``decode 128x2048``, ``decode 64x(8192+256) unshared``,
plain graphs). Each candidate ``d128/g4/decode`` entry (the table's first, then
``sweep_triton.decode_candidates`` and the decode kernel split over the SMs) is checked against the
float32 reference on the shared row (relative error <= 2e-2, no NaN) before it is timed
(``triton.testing.do_bench``, median, L2 flushed). One JSON line a (candidate, row); nothing is written
to the table: a winner goes in by hand, with the bench run that confirms it.
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

from sweep_cascade_prefix import graph_ms, table_entry  # noqa: E402
from sweep_triton import bench_ms, decode_candidates  # noqa: E402

from attnplug.bench import workloads  # noqa: E402
from attnplug.core import AttentionConfig  # noqa: E402
from attnplug.core.cuda_graph import GraphState  # noqa: E402
from attnplug.core.kernels import tiles  # noqa: E402

CFG = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
ROWS = ("cascade decode 64x(8192+256)", "decode 64x4096", "decode 128x2048", "decode 64x(8192+256) unshared")


def candidates() -> list[dict | None]:
    """``None`` (the table's entry), the unsplit decode candidates of the sweep, the decode kernel split to
    4-8 programs an SM (fused merge: a graph replayed at short contexts runs fewer active splits)."""
    split = [
        {"kernel": "decode", "block_n": bn, "num_warps": w, "num_stages": s, "ctas_per_sm": c, "fused_merge": True}
        for bn, w, s in ((64, 4, 5), (128, 4, 5))
        for c in (4, 8)
    ]
    return [None, *decode_candidates(CFG.head_dim, False), *split]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON lines path")
    ap.add_argument("--limit", type=int, default=None, help="first N candidates only")
    a = ap.parse_args()
    dev = torch.device("cuda")
    key = tiles.key(CFG.head_dim, CFG.group_size, "decode")
    works = {r.name: workloads.build(r, CFG, dev) for r in workloads.FULL_ROWS if r.name in ROWS}
    shared = works[ROWS[0]]
    ref = workloads.reference(shared, workloads.ref_requests(shared.row))
    us = lambda fn: round(graph_ms(fn, dev, bench_ms) * 1e3, 2)  # noqa: E731 - a graph replay, microseconds
    with open(a.out, "w") as out_f:
        for cand in candidates()[: a.limit]:
            rec = {"entry": cand if cand is not None else dict(tiles.TILES.get(key, {}), table=True)}
            try:
                with table_entry(tiles, key, cand):
                    for name in ROWS:
                        w = works[name]
                        B = w.batch.batch_size
                        gs = GraphState(
                            CFG,
                            "triton",
                            max_batch=B,
                            max_tokens=B,
                            max_pages=w.num_pages,
                            device=dev,
                            max_seq_len=w.block_table.shape[1] * CFG.page_size,
                            cascade="auto" if name == ROWS[0] else "off",
                        )
                        gs.prepare_capture(B)
                        gs.update_from_block_table(w.seq_lens, w.block_table, B)
                        out = torch.full_like(w.q, float("nan"))
                        if name == ROWS[0]:
                            gs.run(B, w.q, w.k_cache, w.v_cache, out)
                            err = workloads.rel_err(out[: ref.shape[0]], ref)
                            rec["err"] = err
                            rec["splits"] = gs.plans[B].state.num_splits
                            if not err <= 2e-2:
                                rec["dropped"] = "error"
                                break
                            s_lse = gs.cascade.lse_suffix[:B]
                            rec["suffix_us"] = us(
                                lambda: gs.provider.run(gs.plans[B], w.q, w.k_cache, w.v_cache, out, s_lse)
                            )
                        rec[f"{name} us"] = us(lambda: gs.run(B, w.q, w.k_cache, w.v_cache, out))
            except Exception as e:  # e.g. out of shared memory: the candidate is dropped
                rec["dropped"] = f"{type(e).__name__}: {str(e)[:200]}"
            out_f.write(json.dumps(rec) + "\n")
            out_f.flush()
            print("sweep-suffix:", json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
