"""Shared-prefix (cascade) attention inside decode CUDA graphs: replay time of one layer's attention
with ``GraphState(cascade=...)`` "auto" vs "off", on the issue's shared batch and on the same
lengths with nothing shared, next to the eager cascade plan of the same batch (same run).

    python benchmarks/probes/cascade_graph_bench.py --out DIR      # GPU; JSON to DIR/cascade-graph.json

64 requests x (8192 shared + 256 own) tokens + 1 decode token, 32/8 heads, d 128, page 16, bf16,
laid out by the core's paged KV manager with its radix cache (``attnplug.bench.shared_prefix``).
Each replay is checked against the float32 reference of the whole batch before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention
from attnplug.core.cuda_graph import GraphState
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention


def timed_ms(fn, reps: int = 200) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` (after 20 warm calls); on CPU (the smoke run) one call."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def graph_ms(fn) -> float:
    """Replay time of ``fn`` captured alone in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timed_ms(g.replay)


def parts(gs, B, q, k, v) -> dict:
    """Replay time of each launch group of the cascade step, each captured alone: the suffix decode,
    the prefix part (its split kernel and split merge), the LSE merge."""
    from attnplug.core.kernels.merge import merge_state

    c, out = gs.cascade, torch.empty_like(q)
    st = gs.plans[B].state
    plan_info = {
        k: getattr(st, a)
        for k, a in (("splits", "num_splits"), ("kernel", "kernel"), ("block_n", "block_n"))
        if hasattr(st, a)
    }
    if c is None:
        return dict(suffix=graph_ms(lambda: gs.provider.run(gs.plans[B], q, k, v, out)), suffix_plan=plan_info)
    s_lse = c.lse_suffix[:B]
    return dict(
        suffix=graph_ms(lambda: gs.provider.run(gs.plans[B], q, k, v, out, s_lse)),
        prefix=graph_ms(lambda: c.provider.run(c.plans[B], q, k, v, c.out_part[:B], c.lse_part[:B])),
        merge_state=graph_ms(lambda: merge_state(out, s_lse, c.out_part[:B], c.lse_part[:B], out, s_lse)),
        prefix_run_merge=graph_ms(
            lambda: c.provider.run_merge(c.plans[B], q, k, v, out, s_lse, c.out_part[:B], c.lse_part[:B])
        ),
        suffix_plan=plan_info,
    )


def prefix_sweep(gs, B, q, k, v) -> list[dict]:
    """The prefix part's replay time over triton knobs (block_m, block_n, splits, warps, stages), fresh
    plans on the same prefix batch; the default plan's first."""
    import itertools

    c, rows = gs.cascade, []
    op, lp = torch.empty_like(c.out_part[:B]), torch.empty_like(c.lse_part[:B])
    configs = [dict()] + [
        dict(block_m=m, block_n=n, num_kv_splits=s, num_warps=w, num_stages=st)
        for m, n, s, w, st in itertools.product((64, 128), (64, 128), (16, 32, 64), (4, 8), (2, 3))
    ]
    for knobs in configs:
        plan = c._plan(B)
        plan.options = c.provider.parse_options(knobs)
        try:
            c.provider.plan(plan)
            ms = graph_ms(lambda: c.provider.run(plan, q, k, v, op, lp))
            st = plan.state
            rows.append(
                dict(knobs=knobs, ms=ms, splits=st.num_splits, block_m=st.block_m, block_n=st.block_n, kernel=st.kernel)
            )
        except Exception as e:  # a knob set the kernel cannot compile (shared memory): recorded, not fatal
            rows.append(dict(knobs=knobs, error=repr(e)[:200]))
    return rows


def captured(gs, B, q, k, v, out, dev):
    """``gs.run(B, q, k, v, out)`` run once, then captured in a CUDA graph (its ``replay``); on CPU (the
    smoke runs, Triton interpreter) the same launches, uncaptured."""
    gs.run(B, q, k, v, out)
    if dev.type != "cuda":
        return type("Eager", (), {"replay": staticmethod(lambda: gs.run(B, q, k, v, out))})
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gs.run(B, q, k, v, out)
    return g


def row(cfg, spec, unique, dev, provider="triton", sweep=False, eager=True) -> dict:
    batch, q, k, v, num_pages = shared_prefix_batch(cfg, ForwardMode.DECODE, prompts(spec, unique), device=dev)
    B = batch.batch_size
    ref, _ = reference_attention(make_plan(cfg, batch, num_pages, device=dev), q, k, v)
    res = {}
    max_seq = int(((batch.kv_indptr[1:] - batch.kv_indptr[:-1]).max()) * cfg.page_size)
    for mode in ("off", "auto"):
        gs = GraphState(
            cfg,
            provider,
            max_batch=B,
            max_tokens=B,
            max_pages=num_pages,
            device=dev,
            pad_page=num_pages - 1,
            max_seq_len=max_seq,
            cascade=mode,
        )
        gs.prepare_capture(B)
        gs.update(batch, B)
        out = torch.empty_like(q)
        g = captured(gs, B, q, k, v, out, dev)
        out.zero_()
        g.replay()
        err = rel_err(out, ref)
        res[f"graph_{mode}"] = dict(
            ms=timed_ms(g.replay),
            rel_err=err,
            finite=bool(torch.isfinite(out).all()),
            shared_pages=int(gs.cascade.kv_lens.sum()) // cfg.page_size if gs.cascade else 0,
            found_pages=int(gs.cascade.shared[0]) if gs.cascade else 0,
        )
        seq = ((batch.kv_indptr[1:] - batch.kv_indptr[:-1] - 1) * cfg.page_size + batch.kv_last_page_len).to(
            torch.int32
        )
        W = int((batch.kv_indptr[1:] - batch.kv_indptr[:-1]).max())
        table = torch.zeros(B, W, dtype=torch.int32)
        for b in range(B):
            pages = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
            table[b, : pages.numel()] = pages
        seq_d, table_d = seq.to(dev), table.to(dev)
        res[f"graph_{mode}"]["update_from_block_table_ms"] = timed_ms(
            lambda: gs.update_from_block_table(seq_d, table_d, B)
        )
        gs.update_from_block_table(seq_d, table_d, B)
        out.zero_()
        g.replay()
        res[f"graph_{mode}"]["rel_err_device_update"] = rel_err(out, ref)
        if dev.type == "cuda":
            res[f"graph_{mode}"]["parts_ms"] = parts(gs, B, q, k, v)
            if sweep and gs.cascade.tile_options and mode == "auto" and int(gs.cascade.kv_lens.sum()) > 0:
                res["prefix_sweep"] = prefix_sweep(gs, B, q, k, v)
    for mode in ("off", "auto") if eager else ():
        attn = PagedAttention(cfg, provider, dev, cascade=mode)
        attn.plan(batch, num_pages=num_pages)
        out = torch.empty_like(q)
        attn.run(q, k, v, out=out)
        res[f"eager_{mode}"] = dict(ms=timed_ms(lambda: attn.run(q, k, v, out=out)), rel_err=rel_err(out, ref))
    res["graph_auto_over_off"] = res["graph_off"]["ms"] / res["graph_auto"]["ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), 4 x (64 + 8) tokens, no timing")
    ap.add_argument("--sweep", action="store_true", help="also time the prefix part over triton knobs (GPU)")
    ap.add_argument("--providers", default="triton,fa3", help="providers whose decode graphs run cascade (GPU)")
    ap.add_argument("--only", default="", help="comma-separated substrings: only rows whose name has one")
    ap.add_argument("--graphs-only", action="store_true", help="skip the eager (plan/run) timings")
    a = ap.parse_args()
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev, cfg, n, shared, own = torch.device("cpu"), AttentionConfig(4, 2, 32, 16, torch.bfloat16), 4, 64, 8
    else:
        dev, cfg, n, shared, own = torch.device("cuda"), AttentionConfig(32, 8, 128, 16, torch.bfloat16), 64, 8192, 256
    providers = ["triton"] if a.smoke else [p for p in a.providers.split(",") if p]
    specs = []  # (name, groups, unique tokens, sweep)
    for p in providers:
        specs += [
            (p, f"{p} {n}x({shared} shared + {own})", [(n, shared)], own, a.sweep),
            (p, f"{p} {n}x({shared} + {own}) nothing shared", [(1, shared)] * n, own, False),
        ]
        if not a.smoke:  # shorter contexts, where an empty prefix part weighs more
            specs += [
                (p, f"{p} 64x(768 + 256) nothing shared", [(1, 768)] * 64, 256, False),
                (p, f"{p} 8x(8192 + 256) nothing shared", [(1, 8192)] * 8, 256, False),
                (p, f"{p} 16x(2048 shared + 256)", [(16, 2048)], 256, False),
            ]
            # small batches of short contexts, where the empty prefix part weighs most against the step
            specs += [(p, f"{p} {m}x(768 + 256) nothing shared", [(1, 768)] * m, 256, False) for m in (2, 4, 8, 16)]
    only = [x for x in a.only.split(",") if x]
    rows = {
        name: row(cfg, groups, own_, dev, p, sweep=sw, eager=not a.graphs_only)
        for p, name, groups, own_, sw in specs
        if not only or any(x in name for x in only)
    }
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    print(json.dumps(res, indent=1), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cascade-graph.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
