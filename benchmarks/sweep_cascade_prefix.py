"""Offline sweep of the triton provider's ``noncausal`` tile entry: the cascade's shared-prefix part
(issue 13), on the bench's shared-prefix row (64 x (8192 shared + 256), Llama-3-8B attention, page 16).

    python benchmarks/sweep_cascade_prefix.py --out DIR [--write] [--block-m 256]   # GPU
    python benchmarks/sweep_cascade_prefix.py --smoke                  # CPU check of the flow (interpreter)

Each candidate entry (kernel / block_m / block_n / warps / stages / ``ctas_per_sm`` / ``partials``) plans the row
with cascade
on; its prefix part (the paged kernel over the shared pages for all 64 query rows, split-KV, and the
merge of its splits) is captured in one CUDA graph and timed as replays (``triton.testing.do_bench``,
median; eager launches would time the host). The whole forward (suffix + prefix + merges) is checked
against the float32 reference first: a candidate above 2e-2 relative error or with NaN is dropped.
Writes ``DIR/sweep-cascade-prefix.jsonl`` (one line per candidate: entry, splits, ms, err) and, with
``--write``, puts the fastest entry in ``attnplug/core/kernels/tiles.py`` (when it beats the table's own).
On the GPU the winner's split merge is then timed alone per heads a program and partial dtype (``merge`` lines).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

ROW = "cascade decode 64x(8192+256)"


def candidates() -> list[dict]:
    """The table's paged runner-up of the 2026-12-03 sweeps (``h200-sweep-cascade-prefix-2026-12-03*.jsonl``),
    then the prefill kernel run non-causal (8 warps: one program an SM by registers; 16 warps for 256-row
    tiles), each with float32 partials and with partials in the output dtype (``partials: "out"``)."""
    out = [{"kernel": "paged", "block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 2}]
    pre = [
        (128, bn, 8, st, c) for bn, st, c in ((128, 2, 1), (128, 2, 2), (64, 3, 1), (64, 4, 1), (32, 3, 2), (32, 4, 2))
    ]
    # one 256-row tile for all 64 tokens x 4 heads (K/V read once): 16 warps, 128 registers, no spills in
    # the sm90 AOT stats at block_n 64 (block_n 128 spills)
    pre += [(256, bn, 16, st, 1) for bn, st in ((64, 2), (64, 3), (32, 3))]
    # 64-row tiles on one warpgroup: 2-3 programs an SM interleave their softmax and wgmmas (K/V read per 64 rows)
    pre += [(64, bn, 4, st, c) for bn, st, c in ((64, 3, 2), (64, 2, 2), (32, 4, 3), (64, 3, 4))]
    for bm, bn, w, st, c in pre:
        for partials in (None, "out"):
            e = {"kernel": "prefill", "block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st, "ctas_per_sm": c}
            out.append(e if partials is None else {**e, "partials": partials})
    return out


@contextlib.contextmanager
def table_entry(tiles, key: str, entry: dict | None):
    """``tiles.TILES[key]`` set to ``entry`` (``None``: the table's own) inside the block, the table restored after."""
    saved = dict(tiles.TILES)
    if entry is not None:
        tiles.TILES[key] = entry
    try:
        yield
    finally:
        tiles.TILES.clear()
        tiles.TILES.update(saved)


def graph_ms(fn, dev, bench_ms) -> float:
    """``bench_ms`` of ``fn`` captured alone in one CUDA graph and replayed (CPU: of ``fn`` itself)."""
    if dev.type != "cuda":
        return bench_ms(fn, dev)
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench_ms(g.replay, dev)


def merge_probe(cp, dev, bench_ms) -> list[dict]:
    """The split merge alone (one CUDA graph of :func:`merge_splits` on ``cp``'s prefix partials), per
    heads a program, warps a program and partial dtype (float32 / bf16): where the merge time goes."""
    import torch

    from attnplug.core.kernels.merge import merge_splits

    a = cp.prefix.state
    recs = []
    for dt in (torch.float32, torch.bfloat16):
        p = a.partial.to(dt)
        for bh in (1, 2, 4, 8):
            for nw in (1, 2, 4, 8):
                ms = graph_ms(
                    lambda: merge_splits(p, a.partial_lse, cp.out_part, cp.lse_part, block_h=bh, num_warps=nw),
                    dev,
                    bench_ms,
                )
                recs.append(
                    {
                        "merge": {
                            "block_h": bh,
                            "num_warps": nw,
                            "partials": str(dt).removeprefix("torch."),
                            "splits": a.num_splits,
                        },
                        "ms": ms,
                    }
                )
            print("sweep-prefix:", json.dumps(recs[-1]), flush=True)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sweep-out")
    ap.add_argument("--write", action="store_true", help="put the winner in attnplug/core/kernels/tiles.py")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the flow (Triton interpreter, the quick row)")
    ap.add_argument(
        "--block-m", type=int, default=None, help="only the candidates of this block_m (and the table's entry)"
    )
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"

    import torch
    from sweep_triton import bench_ms, table_meta, write_table

    from attnplug.bench import workloads
    from attnplug.core import AttentionConfig, PagedAttention
    from attnplug.core.kernels import tiles

    dev = torch.device("cpu" if a.smoke else "cuda")
    rows, config = (
        (workloads.QUICK_ROWS, workloads.QUICK_CONFIG) if a.smoke else (workloads.FULL_ROWS, workloads.FULL_CONFIG)
    )
    row = next(r for r in rows if r.name.startswith("cascade decode"))
    work = workloads.build(row, AttentionConfig(**config), dev)
    ref = workloads.reference(work, workloads.ref_requests(row))
    cfg = work.config
    key = tiles.key(cfg.head_dim, cfg.group_size, "noncausal")
    os.makedirs(a.out, exist_ok=True)
    results = []
    cands = [c for c in candidates() if a.block_m is None or c["block_m"] == a.block_m]
    cands = [None] + (cands[::3][:2] if a.smoke else cands)  # smoke: a paged and a prefill entry
    for cand in cands:
        try:
            with table_entry(tiles, key, cand):
                attn = PagedAttention(cfg, "triton", dev, cascade="always")
                if a.smoke:
                    attn.provider._sms = 132
                plan = attn.plan(work.batch, num_pages=work.num_pages)
                cp = plan.cascade
                rec = {
                    "entry": cand,
                    "kernel": cp.prefix.state.kernel if cp else None,
                    "splits": cp.prefix.state.num_splits if cp else None,
                }
                out = torch.full_like(work.q, float("nan"))
                attn.run(work.q, work.k_cache, work.v_cache, out=out)
                err = workloads.rel_err(out[: ref.shape[0]], ref)
                rec["err"] = err
                if cp is None or not err <= 2e-2:
                    rec["dropped"] = "no cascade plan" if cp is None else "error"
                else:
                    prov = attn.provider

                    def part():
                        prov.run(
                            cp.prefix,
                            work.q if cp.rows is None else cp.q_part,
                            work.k_cache,
                            work.v_cache,
                            cp.out_part,
                            cp.lse_part,
                        )

                    rec["prefix_ms"] = graph_ms(part, dev, bench_ms)
        except Exception as e:  # e.g. out of shared memory: the candidate is dropped
            rec = {"entry": cand, "dropped": f"{type(e).__name__}: {str(e)[:200]}"}
        results.append(rec)
        print("sweep-prefix:", json.dumps(rec), flush=True)
    with open(os.path.join(a.out, "sweep-cascade-prefix.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    timed = [r for r in results if "prefix_ms" in r]
    if not timed:
        print("sweep-prefix: nothing timed", flush=True)
        return 1
    best = min(timed, key=lambda r: r["prefix_ms"])
    seed = results[0].get("prefix_ms")
    print(
        f"sweep-prefix: table entry {seed} ms; best {best['prefix_ms']} ms {best['entry']} ({best['splits']} splits)",
        flush=True,
    )
    if a.write and best["entry"] is not None and not a.smoke:
        path = os.path.join(os.path.dirname(HERE), "attnplug", "core", "kernels", "tiles.py")
        tag = f"{key} from benchmarks/sweep_cascade_prefix.py ({ROW}, the prefix part as graph replays); "
        write_table(path, {key: best["entry"]}, tag + table_meta(path).replace(tag, ""))
    if dev.type == "cuda":  # the merge of the winner's splits alone
        try:
            with table_entry(tiles, key, best["entry"]):
                attn = PagedAttention(cfg, "triton", dev, cascade="always")
                cp = attn.plan(work.batch, num_pages=work.num_pages).cascade
                if cp is not None and cp.prefix.state.num_splits > 1:
                    attn.provider.run(
                        cp.prefix,
                        work.q if cp.rows is None else cp.q_part,
                        work.k_cache,
                        work.v_cache,
                        cp.out_part,
                        cp.lse_part,
                    )
                    probe = merge_probe(cp, dev, bench_ms)
                    with open(os.path.join(a.out, "sweep-cascade-prefix.jsonl"), "a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in probe)
        except Exception as e:  # the table is written already; the probe is information
            print(f"sweep-prefix: merge probe failed: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
