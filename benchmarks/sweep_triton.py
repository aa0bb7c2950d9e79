"""Offline tile sweep of the triton provider (GPU): measures candidate configs per (head_dim, GQA group,
query bucket) on the benchmark's shapes and writes the winners into the committed table
``attnplug/core/kernels/tiles.py`` (no autotuning in the serving path).

    bash scripts/gpu_run.sh python3 benchmarks/sweep_triton.py --out $OUT/sweep --write   # ~2-3 min on an H200

1. Compile: every (row, candidate) is launched once in ``--jobs`` worker processes (Triton's JIT fills
   its on-disk cache; the compiles run in parallel on the host's cores).
2. Time: in this process, one row at a time (inputs built once), each candidate planned through the
   table, checked against the row's seed output (relative error <= 2e-2; a wrong candidate is
   dropped), then ``triton.testing.do_bench`` (median, L2 flushed).
3. Choose per bucket the candidate with the best geometric-mean speedup over the seed across the
   bucket's rows; it replaces the seed only when >= 1% faster (noise). ``--write`` rewrites the table
   block of tiles.py (exact-group keys; the seeds stay as fallbacks) and copies it to ``$OUT/tiles.py``;
   every measurement goes to ``$OUT/sweep.jsonl``, the choices to ``$OUT/sweep-choice.json``.

``--smoke``: the same flow on CPU (Triton interpreter, tiny shapes, two candidates a row) - a check of
the script, not of speed.

``--budget`` (seconds, default 170) bounds the timing phase: rows left over keep their table entries.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# (row name, kind, batch, q_len, prefix, (Hq, Hkv, D)[, shared]) - the benchmark's rows (attnplug/bench/workloads.py);
# ``shared``: the leading prefix tokens every request shares (same page ids), planned with cascade off
# (the shared-prefix row of the default path, where the decode kernel's L2 throughput bounds it)
LLAMA, D64, D256 = (32, 8, 128), (32, 8, 64), (16, 8, 256)
ROWS = [
    ("prefill 4x4096", "prefill", 4, 4096, 0, LLAMA),
    ("prefill 1x8192", "prefill", 1, 8192, 0, LLAMA),
    ("extend 8x(512+4096)", "prefill", 8, 512, 4096, LLAMA),
    ("decode 1x32768", "decode", 1, 1, 32767, LLAMA),
    ("decode 4x32768", "decode", 4, 1, 32767, LLAMA),
    ("decode 16x16384", "decode", 16, 1, 16383, LLAMA),
    ("decode 64x4096", "decode", 64, 1, 4095, LLAMA),
    ("decode 128x2048", "decode", 128, 1, 2047, LLAMA),
    ("verify 32x(4096+64 tree)", "verify", 32, 64, 4096, LLAMA),
    ("prefill 4x4096 d64", "prefill", 4, 4096, 0, D64),
    ("decode 1x32768 d64", "decode", 1, 1, 32767, D64),
    ("decode 4x32768 d64", "decode", 4, 1, 32767, D64),
    ("prefill 4x4096 d256", "prefill", 4, 4096, 0, D256),
    ("decode 1x32768 d256", "decode", 1, 1, 32767, D256),
    ("decode 4x32768 d256", "decode", 4, 1, 32767, D256),
    # fp8 (e4m3) KV caches: their own table entries (".../fp8"), candidates with and without fp16 dots
    ("decode 64x4096 fp8", "decode", 64, 1, 4095, LLAMA),
    ("decode 1x32768 fp8", "decode", 1, 1, 32767, LLAMA),
    ("decode 4x32768 fp8", "decode", 4, 1, 32767, LLAMA),
    ("decode 128x2048 fp8", "decode", 128, 1, 2047, LLAMA),
    ("prefill 4x4096 fp8", "prefill", 4, 4096, 0, LLAMA),
    ("decode 64x(8192 shared+256)", "decode", 64, 1, 8192 + 256, LLAMA, 8192),
    ("decode 64x(8192+256) unshared", "decode", 64, 1, 8192 + 256, LLAMA),
]
# a page-64 prefill: where tensor-descriptor (TMA) K/V loads apply; decides the table's "tma" flag
TMA_ROW = ("prefill 4x4096 page64", "prefill", 4, 4096, 0, LLAMA)
# --smoke (CPU, Triton interpreter): the whole flow on tiny shapes, two candidates a row, SM count 132
SMOKE_ROWS = [
    ("prefill smoke", "prefill", 2, 80, 16, (8, 2, 64)),
    ("decode smoke", "decode", 2, 1, 2100, (8, 2, 64)),
    ("prefill smoke page64", "prefill", 1, 70, 0, (8, 2, 64)),
    ("decode smoke fp8", "decode", 2, 1, 2100, (8, 2, 64)),
    ("decode smoke shared", "decode", 3, 1, 300, (8, 2, 64), 256),
]
SMOKE = {"on": False}
FULL = ("decode", "decode_wide")  # the unsplit decode buckets (full batches)
PAIRS_ONLY = {"on": False}  # --pairs-only: fp8 rows time only the byte-pair candidates (and the seed)
DEEP = {"on": False}  # --deep: the d128 decode rows time only deeper-pipeline candidates (and the seed)


def prefill_candidates(d: int) -> list[dict]:
    """The prefill kernel (and the general one with deeper pipelines) at wgmma-sized tiles. Stages:
    the page-id load and the row load chain, so rows run (stages - 1) // 2 blocks ahead."""
    return _prefill_tiles(d)


def _prefill_tiles(d: int) -> list[dict]:
    p = lambda bm, bn, w, s, **kw: {
        "kernel": "prefill",
        "block_m": bm,
        "block_n": bn,
        "num_warps": w,
        "num_stages": s,
        **kw,
    }
    if d <= 64:
        return [
            p(128, bn, w, s)
            for bn, w, s in ((64, 4, 5), (64, 8, 5), (128, 8, 5), (128, 4, 3), (128, 8, 3), (64, 4, 7), (128, 4, 5))
        ] + [p(128, 128, 8, 5, diag_n=64), p(128, 64, 4, 5, diag_n=0), p(128, 128, 8, 5, diag_n=0)]
    if d <= 128:
        # 4 warps at 128 rows spill on sm90 (255 registers + stack, sm90_aot.py --stats): 8 warps only.
        # 64-row tiles on 4 warps (one warpgroup; 64 x 64: 198-208 registers, 82 KB shared; 64 x 32: 144, 49 KB)
        # run 2-3 programs an SM, whose softmax and wgmmas the SM's schedulers interleave (K/V read per 64 rows)
        return (
            [
                p(128, bn, w, s)
                for bn, w, s in ((64, 8, 5), (64, 8, 7), (128, 8, 5), (128, 8, 3), (64, 8, 3), (64, 8, 6))
            ]
            + [p(64, 64, 4, 3), p(64, 64, 4, 2), p(64, 64, 4, 3, diag_n=0), p(64, 32, 4, 4), p(64, 32, 4, 3, diag_n=0)]
            + [
                p(128, 128, 8, 5, diag_n=64),
                p(128, 64, 8, 5, diag_n=32),
                p(128, 64, 8, 5, diag_n=0),
                p(128, 128, 8, 5, diag_n=0),
                p(128, 64, 8, 7, diag_n=0),
                {"kernel": "paged", "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 5},
                {"kernel": "paged", "block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 5},
            ]
        )
    return [
        p(bm, bn, w, s)
        for bm, bn, w, s in (
            (64, 32, 4, 5),
            (64, 64, 4, 3),
            (128, 32, 8, 5),
            (128, 64, 8, 3),
            (64, 32, 4, 7),
            (128, 32, 8, 3),
        )
    ] + [p(64, 32, 4, 5, diag_n=0), p(128, 32, 8, 5, diag_n=0)]


def decode_candidates(d: int, split: bool) -> list[dict]:
    """The decode kernel (fused merge or not; split target in programs per SM) and the general kernel
    with deeper pipelines."""
    tiles = ((64, 4, 5), (64, 4, 7), (128, 4, 5)) if d <= 128 else ((64, 4, 5), (32, 4, 7), (64, 8, 5))
    if not split:  # more bytes in flight per program (the shared-prefix row is bound by L2 throughput)
        tiles += ((64, 2, 5), (32, 4, 7), (128, 4, 7), (128, 8, 5), (256, 8, 3)) if d <= 128 else ()
    else:  # long contexts split over the SMs: wider key blocks and more programs per SM keep more loads in flight
        tiles += ((256, 4, 3), (256, 8, 2)) if d <= 128 else ()
    out = []
    for bn, w, s in tiles:
        if not split:
            out.append({"kernel": "decode", "block_n": bn, "num_warps": w, "num_stages": s})
            continue
        for ctas in (1, 2, 4, 8):
            for fused in (True, False):
                out.append(
                    {
                        "kernel": "decode",
                        "block_n": bn,
                        "num_warps": w,
                        "num_stages": s,
                        "ctas_per_sm": ctas,
                        "fused_merge": fused,
                    }
                )
    bn = 128 if d <= 128 else 64
    out.append(
        {"kernel": "paged", "block_n": bn, "num_warps": 4, "num_stages": 5, **({"ctas_per_sm": 2} if split else {})}
    )
    if not split and d <= 128:  # the paged kernel at fewer bytes per program (more programs per SM)
        out += [
            {"kernel": "paged", "block_n": bn, "num_warps": w, "num_stages": s}
            for bn, w, s in ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3), (128, 4, 2), (32, 4, 4), (64, 2, 3))
        ]
    return out


def verify_candidates(d: int) -> list[dict]:
    return [
        {"kernel": "paged", "block_m": 128, "block_n": bn, "num_warps": 8, "num_stages": s}
        for bn, s in ((128, 5), (64, 5))
    ]


def row_config(row):
    import torch

    from attnplug.core import AttentionConfig

    hq, hkv, d = row[5]
    page = 64 if "page64" in row[0] else 16
    return AttentionConfig(hq, hkv, d, page, torch.bfloat16, kv_dtype=torch.float8_e4m3fn if is_fp8(row) else None)


def bucket_of(row, provider) -> str:
    """The table bucket the provider plans ``row`` in (decode rows: by programs = B * Hkv, as
    ``TritonProvider._decode_bucket``; every swept decode row is long enough to split)."""
    kind = row[1]
    if kind in ("verify", "prefill"):
        return kind
    return provider._decode_bucket(row[2] * row_config(row).num_kv_heads)


def is_fp8(row) -> bool:
    return row[0].endswith(" fp8")


def deep_candidates(row, bucket: str) -> list[dict]:
    """``--deep``: the decode kernel with deeper pipelines than the default candidates (rows run
    ``(stages - 1) // 2`` blocks ahead; the shared memory this takes, sm90_aot: fp8 32-key blocks on one
    warp 29 KB at 7 stages, 37 / 46 / 54 KB at 9 / 11 / 13, so four programs an SM still fit)."""
    d = row[5][2]
    if row[1] != "decode" or d != 128:
        return []
    fp8 = is_fp8(row)
    extra = dict(fp8_f16=True, pairs=True) if fp8 else {}
    if bucket in FULL:
        tiles = (
            ((32, 1, 9), (32, 1, 11), (32, 1, 13), (16, 1, 13), (16, 1, 17), (64, 2, 9), (32, 2, 11))
            if fp8
            else ((64, 2, 5), (64, 2, 7), (32, 2, 9), (64, 4, 7), (32, 1, 9), (32, 1, 13))
        )
        return [{"kernel": "decode", "block_n": bn, "num_warps": w, "num_stages": st, **extra} for bn, w, st in tiles]
    tiles = (
        ((128, 4, 7, (1, 2)), (64, 4, 9, (1, 2)), (64, 4, 11, (1, 2)), (64, 2, 9, (2, 4)))
        if fp8
        else ((64, 4, 9, (1,)), (64, 4, 11, (1,)), (32, 4, 13, (1, 2)), (32, 2, 13, (2, 4)), (128, 4, 7, (1,)))
    )
    return [
        {
            "kernel": "decode",
            "block_n": bn,
            "num_warps": w,
            "num_stages": st,
            "ctas_per_sm": c,
            "fused_merge": True,
            **extra,
        }
        for bn, w, st, ctas in tiles
        for c in ctas
    ]


def candidates(row, bucket: str) -> list[dict]:
    if DEEP["on"]:
        return deep_candidates(row, bucket)
    d = row[5][2]
    if bucket == "prefill":
        out = prefill_candidates(d)
    elif bucket == "verify":
        out = verify_candidates(d)
    else:
        out = decode_candidates(d, bucket not in FULL)
    if not is_fp8(row):
        return out
    out = [dict(c, fp8_f16=f) for c in out for f in (False, True)]
    if bucket in FULL and d <= 128:  # half the bytes a key: fewer warps a program, or full batches split
        tiles = (
            (64, 1, 5),
            (64, 1, 3),
            (32, 1, 5),
            (32, 2, 5),
            (64, 2, 3),
            (64, 2, 4),
            (64, 2, 7),
            (128, 2, 3),
            (128, 2, 5),
            (128, 2, 7),
            (32, 1, 7),
            (32, 1, 4),
            (32, 1, 6),
            (16, 1, 7),
            (64, 1, 7),
        )
        out += [
            {"kernel": "decode", "block_n": bn, "num_warps": w, "num_stages": st, "fp8_f16": True}
            for bn, w, st in tiles
        ]
        splits = (
            (64, 2, 5, (4, 8)),
            (64, 4, 5, (4, 8)),
            (128, 2, 5, (4, 8)),
            (128, 4, 5, (4, 8)),
            (32, 1, 5, (8, 16)),
            (32, 1, 7, (8, 16)),
        )  # (block_n, warps, stages, programs an SM)
        out += [
            {
                "kernel": "decode",
                "block_n": bn,
                "num_warps": w,
                "num_stages": st,
                "fp8_f16": True,
                "ctas_per_sm": c,
                "fused_merge": True,
            }
            for bn, w, st, ctas in splits
            for c in ctas
        ]
    if d in (64, 128, 256):  # the decode kernel reading K/V as byte pairs (power-of-two head dims)
        pairs = [
            dict(c, pairs=True) for c in out if c["kernel"] == "decode" and c["fp8_f16"] and c.get("fused_merge", True)
        ]
        out = pairs if PAIRS_ONLY["on"] else out + pairs
    return out


def build(row, device):
    from attnplug.bench.workloads import Row
    from attnplug.bench.workloads import build as wbuild

    name, kind, b, q, prefix = row[:5]
    return wbuild(
        Row(name, kind, b, q, prefix, shared=row[6] if len(row) > 6 else 0, kv="fp8" if is_fp8(row) else ""),
        dataclasses.replace(row_config(row), kv_dtype=None),
        device,
    )


def plan_run(work, entry: dict | None, key: str):
    """A PagedAttention planned with ``entry`` at ``key`` (None: the table as it is) and its run fn."""
    import torch

    from attnplug.core import PagedAttention
    from attnplug.core.kernels import tiles

    saved = dict(tiles.TILES)
    if entry is not None:
        tiles.TILES[key] = entry
    try:
        attn = PagedAttention(work.config, "triton", work.q.device, cascade="off")
        if SMOKE["on"]:
            attn.provider._sms = 132
        plan = attn.plan(work.batch, num_pages=work.num_pages)
    finally:
        tiles.TILES.clear()
        tiles.TILES.update(saved)
    out = torch.empty_like(work.q)
    q, k, v = work.q, work.k_cache, work.v_cache
    return plan, out, (lambda: attn.run(q, k, v, out=out))


def tasks(rows):
    """[(row index, table key, candidate, group)] for every row (candidate None: the table as it is,
    the seed); ``group`` is the key, or ``key#tma`` for the page-64 row (it decides only ``tma``)."""
    from attnplug.core import PagedAttention
    from attnplug.core.kernels import tiles

    out = []
    for i, row in enumerate(rows):
        cfg = row_config(row)
        prov = PagedAttention(cfg, "triton", "cpu" if SMOKE["on"] else "cuda").provider
        if SMOKE["on"]:
            prov._sms = 132
        bucket = bucket_of(row, prov)
        key = tiles.key(cfg.head_dim, cfg.group_size, bucket, fp8=is_fp8(row))
        cands = candidates(row, bucket)
        if SMOKE["on"]:  # small tiles the interpreter runs quickly
            cands = [
                dict(c, block_m=min(c.get("block_m", 32), 32), block_n=min(c.get("block_n", 32), 32), num_stages=3)
                for c in cands[:2]
            ] + (
                [{"kernel": "decode", "block_n": 32, "ctas_per_sm": 1, "fused_merge": True}]
                if bucket.startswith("decode")
                else []
            )
        group = key
        if "page64" in row[0]:
            cands = [dict(c, tma=t) for c in cands[:4] if c["kernel"] == "prefill" for t in (False, True)]
            group = key + "#tma"
        out += [(i, key, None, group)] + [(i, key, c, group) for c in cands]
    return out


def compile_worker(args):
    """Worker process: launch each assigned (row, candidate) once (fills Triton's disk cache)."""
    rows, items, smoke = args
    SMOKE["on"] = smoke
    import torch

    dev = torch.device("cpu" if smoke else "cuda")
    done, cache = [], {}
    for i, key, cand, _ in items:
        try:
            if i not in cache:
                if len(cache) >= 3:
                    cache.pop(next(iter(cache)))
                cache[i] = build(rows[i], dev)
            _, _, fn = plan_run(cache[i], cand, key)
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            done.append((i, key, json.dumps(cand, sort_keys=True), None))
        except Exception as e:  # e.g. out of shared memory: the candidate is dropped
            done.append((i, key, json.dumps(cand, sort_keys=True), f"{type(e).__name__}: {str(e)[:200]}"))
            try:  # a fault that poisoned the context: leave the rest to the main process
                torch.zeros(1, device=dev).add_(1).cpu()
            except Exception:
                break
    return done


def bench_ms(fn, device) -> float:
    if device.type == "cuda":
        import triton.testing as tt

        return tt.do_bench(fn, warmup=10, rep=40, return_mode="median")
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def table_meta(path: str) -> str:
    """The comment line :func:`write_table` put above the table (what chose its entries)."""
    return re.search(r"# ---- BEGIN TILES.*?\n# (.*)\n", open(path).read()).group(1)


def write_table(path: str, chosen: dict, meta: str) -> None:
    from attnplug.core.kernels import tiles

    table = dict(tiles.TILES)
    table.update(chosen)
    src = open(path).read()
    lines = [f"    {k!r}: {table[k]!r}," for k in sorted(table)]
    block = (
        "# ---- BEGIN TILES (rewritten by benchmarks/sweep_triton.py) ----\n"
        f"# {meta}\n# fmt: off\nTILES: dict[str, dict] = {{\n"
        + "\n".join(lines)
        + "\n}\n# fmt: on\n# ---- END TILES ----"
    )
    new = re.sub(r"# ---- BEGIN TILES.*?# ---- END TILES ----", lambda m: block, src, flags=re.S)
    assert new != src or block in src
    open(path, "w").write(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sweep-out")
    ap.add_argument("--write", action="store_true", help="rewrite attnplug/core/kernels/tiles.py with the winners")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the whole sweep (timing stops there)")
    ap.add_argument(
        "--rows",
        default="",
        help="comma-separated row-name substrings (default: all); one ending in '$' matches the name's end",
    )
    ap.add_argument(
        "--table",
        default=os.path.join(os.path.dirname(HERE), "attnplug", "core", "kernels", "tiles.py"),
        help="the table file --write rewrites",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU check of the flow (Triton interpreter, tiny shapes)")
    ap.add_argument("--pairs-only", action="store_true", help="fp8 rows: only the byte-pair candidates (and the seed)")
    ap.add_argument(
        "--deep", action="store_true", help="d128 decode rows: only deeper-pipeline candidates (and the seed)"
    )
    a = ap.parse_args(argv)
    PAIRS_ONLY["on"], DEEP["on"] = a.pairs_only, a.deep
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    SMOKE["on"] = a.smoke
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import multiprocessing as mp

    import torch

    rows = SMOKE_ROWS if a.smoke else ROWS + [TMA_ROW]
    if a.rows:
        sel = [s.strip() for s in a.rows.split(",") if s.strip()]
        rows = [r for r in rows if any(r[0].endswith(s[:-1]) if s.endswith("$") else s in r[0] for s in sel)]
    todo = tasks(rows)
    print(f"sweep: {len(rows)} rows, {len(todo)} (row, candidate) pairs, {a.jobs} compile workers", flush=True)

    # 1. compile in parallel: tasks sorted by (heads, candidate) so that rows sharing a kernel are
    #    compiled by the same worker (one compile, then disk-cache hits), in contiguous chunks
    groups = [[] for _ in range(a.jobs)]
    order = sorted(todo, key=lambda t: (rows[t[0]][5], json.dumps(t[2], sort_keys=True), t[0]))
    for n, t in enumerate(order):
        groups[n * a.jobs // len(todo)].append(t)
    failed = {}
    ctx = mp.get_context("spawn")
    try:  # a worker also runs each candidate once: one that faults on the GPU fails there, not here
        with ctx.Pool(a.jobs) as pool:
            for res in pool.imap_unordered(compile_worker, [(rows, g, a.smoke) for g in groups if g]):
                for i, _key, cand, err in res:
                    if err:
                        failed[(i, cand)] = err
    except Exception as e:  # a dead worker: what it did not compile compiles below, on first use
        print(f"sweep: compile workers failed ({e!r}); continuing", flush=True)
    print(f"sweep: compiled in {time.time() - t0:.0f}s, {len(failed)} candidates failed", flush=True)

    # 2. time
    log = open(os.path.join(a.out, "sweep.jsonl"), "w")
    speed: dict[str, dict[str, list[float]]] = {}  # key -> cand json -> [speedup per row]
    dev = torch.device("cpu" if a.smoke else "cuda")
    for i, row in enumerate(rows):
        if time.time() - t0 > a.budget:
            print(f"sweep: budget spent, {row[0]} and later rows not timed", flush=True)
            break
        work = build(row, dev)
        _, ref_out, seed_fn = plan_run(work, None, "")
        seed_fn()
        ref = ref_out.float().clone()
        seed_ms = bench_ms(seed_fn, dev)
        group0 = None
        for _j, key, cand, group in [t for t in todo if t[0] == i and t[2] is not None]:
            cj = json.dumps(cand, sort_keys=True)
            rec = dict(row=row[0], key=key, cand=cand, seed_ms=seed_ms)
            if (i, cj) in failed:
                rec["error"] = failed[(i, cj)]
            else:
                try:
                    plan, out, fn = plan_run(work, cand, key)
                    fn()
                    err = float((out.float() - ref).norm() / ref.norm())
                    rec.update(kernel=plan.state.kernel, splits=plan.state.num_splits, err=err)
                    if not math.isfinite(err) or err > 2e-2:
                        rec["error"] = f"wrong: rel err {err:.2e} vs the seed"
                    else:
                        ms = bench_ms(fn, dev)
                        rec["ms"] = ms
                        speed.setdefault(group, {}).setdefault(cj, []).append(seed_ms / ms)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            group0 = group
            log.write(json.dumps(rec) + "\n")
            log.flush()
        best = max((r for r in speed.get(group0, {}).items()), key=lambda kv: kv[1][-1], default=None)
        print(
            f"sweep: {row[0]:28s} seed {seed_ms:.4f} ms, best {seed_ms / best[1][-1]:.4f} ms {best[0]}"
            if best
            else f"sweep: {row[0]} nothing timed",
            flush=True,
        )
        del work
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # 3. choose: per table key, the best geometric-mean speedup over the seed on the rows timed
    chosen, report = {}, {}
    for group, cands in speed.items():
        if group.endswith("#tma"):
            continue
        n = max(len(v) for v in cands.values())
        gm = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in cands.items() if len(v) == n}
        c, g = max(gm.items(), key=lambda kv: kv[1])
        report[group] = dict(best=json.loads(c), geomean_speedup=round(g, 4), rows=n, chosen=g >= 1.01)
        if g >= 1.01:
            chosen[group] = json.loads(c)
    # the page-64 row decides whether a chosen prefill-kernel entry loads pages through descriptors
    for group, cands in speed.items():
        if not group.endswith("#tma"):
            continue
        pairs = {}
        for c, v in cands.items():
            cc = json.loads(c)
            pairs.setdefault(json.dumps({k: x for k, x in cc.items() if k != "tma"}, sort_keys=True), {})[cc["tma"]] = (
                v[-1]
            )
        wins = [v[True] / v[False] for v in pairs.values() if False in v and True in v]
        g = math.exp(sum(map(math.log, wins)) / len(wins)) if wins else 0.0
        report[group] = dict(tma_speedup_geomean=round(g, 4), pairs=len(wins), use=g >= 1.01)
        key = group[: -len("#tma")]
        if g >= 1.01 and chosen.get(key, {}).get("kernel") == "prefill":
            chosen[key] = dict(chosen[key], tma=True)
    json.dump(
        dict(chosen=chosen, report=report, wall_s=time.time() - t0),
        open(os.path.join(a.out, "sweep-choice.json"), "w"),
        indent=1,
    )
    for k, r in sorted(report.items()):
        print(f"sweep: {k:24s} {r}", flush=True)
    if a.write:
        import datetime

        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
        version = __import__("triton").__version__
        meta = f"sweep of {datetime.date.today()} on {name}, triton {version}: {len(chosen)} entries chosen"
        write_table(a.table, chosen, meta)
        import shutil

        shutil.copy(a.table, os.path.join(a.out, "tiles.py"))  # to bring back from the GPU machine
        print(f"sweep: wrote {len(chosen)} entries into {a.table} (copy: {a.out}/tiles.py)", flush=True)
    print(f"sweep: done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
