"""Benchmark output: JSON, a markdown table and a PNG bar chart (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import os

# H200 anchors measured 2026-11-29 with shared/tools/anchors.py (shared/measurements/h200-anchors-*.json):
# the same library kernels on the same shapes; a sanity check for this run's numbers.
ANCHORS_H200 = {
    "ceilings": {"copy_GBps": 4248, "matmul_TFLOPs": 708},
    "decode 64x4096": {"flashinfer.decode_tc": 4107, "fa3.paged": 4062, "torch.gather_sdpa": 1290},
    "decode 16x16384": {"flashinfer.decode_tc": 4076, "fa3.paged": 4082, "torch.gather_sdpa": 1297},
    "decode 128x2048": {"flashinfer.decode_tc": 4046, "fa3.paged": 3965, "torch.gather_sdpa": 1286},
    "decode 1x32768": {"flashinfer.decode_tc": 2530, "fa3.paged": 2418, "torch.gather_sdpa": 1060},
    "prefill 4x4096": {"flashinfer.prefill_fa2": 330, "flashinfer.prefill_fa3": 478, "fa3.paged": 550, "torch.gather_sdpa": 165},
    "prefill 1x8192": {"flashinfer.prefill_fa2": 320, "flashinfer.prefill_fa3": 509, "fa3.paged": 582, "torch.gather_sdpa": 154},
    "extend 8x(512+4096)": {"flashinfer.prefill_fa2": 340, "flashinfer.prefill_fa3": 497, "fa3.paged": 533, "torch.gather_sdpa": 290},
}


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _note(s: str, n: int = 150) -> str:
    s = s.replace("|", "/")
    return s if len(s) <= n else s[: n - 1] + "…"


def _err(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else "–"


def markdown(res: dict) -> str:
    env, ceil = res["env"], res.get("ceilings", {})
    anchors = ANCHORS_H200 if "H200" in env.get("device", "") else {}
    lines = [
        f"# attnplug benchmark — {env.get('device')} — {env.get('date')}",
        "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, flashinfer {env.get('flashinfer')}, "
        f"FA3 build: {env.get('fa3')}. Shape: {res['shape']}.",
        "",
        f"Ceilings: copy **{_fmt(ceil.get('copy_GBps'), 0)} GB/s** (read+write), "
        f"matmul **{_fmt(ceil.get('matmul_TFLOPs'), 0)} TFLOP/s** ({ceil.get('matmul_shape', '')})"
        + (f"; H200 anchors: {anchors['ceilings']['copy_GBps']} GB/s, {anchors['ceilings']['matmul_TFLOPs']} TFLOP/s." if anchors else "."),
        "",
        "ms: median of CUDA-event timings (`triton.testing.do_bench`, L2 flushed"
        + ("; every implementation replayed from one CUDA graph: kernels without host launch gaps"
           if env.get("timing") == "cuda-graph replay" else "") + "). GB/s counts Q+K+V+O bytes; "
        "TFLOP/s counts causal FLOPs 4·H·D·(q·kv − q(q−1)/2). *vs best lib* = best direct-library ms / this ms "
        "(> 1: faster than the best library kernel of the row); *vs own lib* = the same family's library kernel "
        "ms / this ms (fp8 rows: triton's own is attnplug's fp8 kernel called directly). err: relative L2 vs "
        "the float32 reference on the first requests (fp8 rows: on the dequantized cache), checked before timing.",
        "",
        "| row | implementation | ms | GB/s | TFLOP/s | vs best lib | vs own lib | err | anchor | plan ms | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        anchor = anchors.get(r["row"], {}).get(r["impl"])
        lines.append(
            f"| {r['row']} | {r['impl']} | {_fmt(r.get('ms'), 4)} | {_fmt(r.get('GBps'), 0)} | "
            f"{_fmt(r.get('TFLOPs'), 1)} | {_fmt(r.get('vs_best_lib'), 2)} | {_fmt(r.get('vs_own_lib'), 2)} | "
            f"{_err(r.get('err'))} | "
            f"{_fmt(anchor)} | {_fmt(r.get('plan_ms'), 2)} | {_note(r.get('status', ''))} |"
        )
    return "\n".join(lines) + "\n"


def summary(res: dict) -> str:
    """Compact plain-text table for logs (the markdown file has everything)."""
    c = res.get("ceilings", {})
    anchors = ANCHORS_H200 if "H200" in res["env"].get("device", "") else {}
    lines = [f"ceilings: copy {_fmt(c.get('copy_GBps'), 0)} GB/s, matmul {_fmt(c.get('matmul_TFLOPs'), 0)} TFLOP/s"
             + (" (H200 anchors 4248 GB/s, 708 TFLOP/s)" if anchors else "")]
    for r in res["rows"]:
        if r.get("ms"):
            fig = f"{r['TFLOPs']:7.1f} TFLOP/s" if r["kind"] == "prefill" else f"{r['GBps']:7.0f} GB/s   "
            vs = f"{r['vs_best_lib']:.2f}x" if r.get("vs_best_lib") else "  -  "
            own = f" own {r['vs_own_lib']:.2f}x" if r.get("vs_own_lib") else ""
            lines.append(f"{r['row']:26s} {r['impl']:24s} {r['ms']:9.4f} ms {fig} {vs:>6s}{own} err {r['err']:.1e}"
                         + (f"  anchor {anchors[r['row']][r['impl']]}" if r["impl"] in anchors.get(r["row"], {}) else ""))
        else:
            lines.append(f"{r['row']:26s} {r['impl']:24s} {_note(r.get('status', ''), 70)}")
    return "\n".join(lines)


def write(res: dict, out_dir: str, stem: str, png: bool = True) -> list[str]:
    """Write ``stem.json`` / ``stem.md`` (and ``stem.png``); returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, stem + ext) for ext in (".json", ".md")]
    with open(paths[0], "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(paths[1], "w") as f:
        f.write(markdown(res))
    if png:
        p = os.path.join(out_dir, stem + ".png")
        try:
            chart(res, p)
            paths.append(p)
        except Exception as e:  # matplotlib missing or broken: the JSON/markdown are what matter
            res.setdefault("warnings", []).append(f"png: {e!r}")
    return paths


def chart(res: dict, path: str) -> None:
    """Grouped bars per kind: GB/s (decode, verify) and TFLOP/s (prefill), ceilings as dashed lines."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    kinds = [k for k in ("decode", "prefill", "verify") if any(r["kind"] == k for r in res["rows"])]
    impls = list(dict.fromkeys(r["impl"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(impls)}
    for ax, kind in zip(axes[0], kinds):
        key = "TFLOPs" if kind == "prefill" else "GBps"
        rows = list(dict.fromkeys(r["row"] for r in res["rows"] if r["kind"] == kind))
        series = []
        for name in impls:
            vals = []
            for row in rows:
                v = next((r.get(key) for r in res["rows"] if r["row"] == row and r["impl"] == name), None)
                vals.append(v if isinstance(v, float) and math.isfinite(v) else 0.0)
            if any(vals):
                series.append((name, vals))
        width = 0.8 / max(len(series), 1)
        for j, (name, vals) in enumerate(series):
            ax.bar([i + j * width for i in range(len(rows))], vals, width, label=name, color=colors[name])
        ax.legend(fontsize=7)
        ceil = res.get("ceilings", {}).get("matmul_TFLOPs" if kind == "prefill" else "copy_GBps")
        if ceil:
            ax.axhline(ceil, ls="--", c="gray", lw=1)
            ax.text(0, ceil, " matmul" if kind == "prefill" else " copy", va="bottom", fontsize=8, color="gray")
        ax.set_xticks([i + (len(series) - 1) * width / 2 for i in range(len(rows))])
        ax.set_xticklabels(rows, rotation=15, fontsize=8)
        ax.set_ylabel("TFLOP/s" if kind == "prefill" else "GB/s")
        ax.set_title(kind)
    fig.suptitle(f"attnplug — {res['env'].get('device')} — {res['env'].get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
