"""Benchmark output: JSON, a markdown table and a PNG bar chart (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import os
import sys

# H200 anchors measured 2026-11-29: the same library kernels on the same shapes, timed by a standalone script;
# a sanity check for this run's numbers.
ANCHORS_H200 = {
    "ceilings": {"copy_GBps": 4248, "matmul_TFLOPs": 708},
    "decode 64x4096": {"flashinfer.decode_tc": 4107, "fa3.paged": 4062, "torch.gather_sdpa": 1290},
    "decode 16x16384": {"flashinfer.decode_tc": 4076, "fa3.paged": 4082, "torch.gather_sdpa": 1297},
    "decode 128x2048": {"flashinfer.decode_tc": 4046, "fa3.paged": 3965, "torch.gather_sdpa": 1286},
    "decode 1x32768": {"flashinfer.decode_tc": 2530, "fa3.paged": 2418, "torch.gather_sdpa": 1060},
    "prefill 4x4096": {
        "flashinfer.prefill_fa2": 330,
        "flashinfer.prefill_fa3": 478,
        "fa3.paged": 550,
        "torch.gather_sdpa": 165,
    },
    "prefill 1x8192": {
        "flashinfer.prefill_fa2": 320,
        "flashinfer.prefill_fa3": 509,
        "fa3.paged": 582,
        "torch.gather_sdpa": 154,
    },
    "extend 8x(512+4096)": {
        "flashinfer.prefill_fa2": 340,
        "flashinfer.prefill_fa3": 497,
        "fa3.paged": 533,
        "torch.gather_sdpa": 290,
    },
}

#: record statuses left out of the tables (one footnote lists them): nothing was measured, nothing went wrong
NOT_RUN = ("n/a", "unavailable", "skipped")


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _note(s: str, n: int = 150) -> str:
    s = " ".join(s.replace("|", "/").split())  # one table cell: no pipes, no line breaks
    return s if len(s) <= n else s[: n - 1] + "…"


def _err(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else "–"


def not_run(rec: dict) -> bool:
    """True for a record that measured nothing by design (n/a, library unavailable, time budget)."""
    return rec.get("status", "").startswith(NOT_RUN)


def _kind_table(kind: str, recs: list[dict], anchors: dict) -> list[str]:
    """One markdown table of a row kind: the records that ran (timed, wrong or failed); columns that are
    empty for every record of the kind are left out."""
    fig_key, fig_name, fig_nd = ("TFLOPs", "TFLOP/s", 1) if kind == "prefill" else ("GBps", "GB/s", 0)
    cols = [
        ("row", lambda r: r["row"]),
        ("implementation", lambda r: r["impl"]),
        ("ms", lambda r: _fmt(r.get("ms"), 4)),
        (fig_name, lambda r: _fmt(r.get(fig_key), fig_nd)),
        ("vs best lib", lambda r: _fmt(r.get("vs_best_lib"), 2)),
        ("vs own lib", lambda r: _fmt(r.get("vs_own_lib"), 2)),
        ("err", lambda r: _err(r.get("err"))),
        ("anchor", lambda r: _fmt(anchors.get(r["row"], {}).get(r["impl"]))),
        ("plan ms", lambda r: _fmt(r.get("plan_ms"), 2)),
        ("note", lambda r: "" if r.get("status") == "ok" else _note(r.get("status", ""))),
    ]
    cells = [[f(r) for _, f in cols] for r in recs]
    keep = [
        j for j, (name, _) in enumerate(cols) if j < 3 or any(c[j] not in ("", "–") for c in cells)
    ]  # row, implementation, ms always
    lines = [f"## {kind}", "", "| " + " | ".join(cols[j][0] for j in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(c[j] for j in keep) + " |" for c in cells]
    return lines + [""]


def _footnote(recs: list[dict]) -> list[str]:
    """The records left out of the tables, one line per reason: the implementation and the rows."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for r in recs:
        by_reason.setdefault((r["impl"], r.get("status", "")), []).append(r["row"])
    if not by_reason:
        return []
    lines = [f"Not run ({len(recs)} records, left out of the tables):", ""]
    for (impl, status), rows in by_reason.items():
        lines.append(f"- {impl}: {_note(status, 200)} ({', '.join(rows)})")
    return lines + [""]


def markdown(res: dict) -> str:
    """The run as markdown: versions and method, one table per row kind (decode, prefill, verify, ...) of
    the implementations that ran, and one footnote listing what did not run and why."""
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
        + (
            f"; H200 anchors: {anchors['ceilings']['copy_GBps']} GB/s, {anchors['ceilings']['matmul_TFLOPs']} TFLOP/s."
            if anchors
            else "."
        ),
        "",
        "ms: median of CUDA-event timings (`triton.testing.do_bench`, L2 flushed"
        + (
            "; every implementation replayed from one CUDA graph: kernels without host launch gaps"
            if env.get("timing") == "cuda-graph replay"
            else ""
        )
        + "). GB/s counts Q+K+V+O bytes; "
        "TFLOP/s counts causal FLOPs 4·H·D·(q·kv − q(q−1)/2). *vs best lib* = best direct-library ms / this ms "
        "(> 1: faster than the best library kernel of the row); *vs own lib* = the same family's library kernel "
        "ms / this ms (fp8 rows: triton's own is attnplug's fp8 kernel called directly). err: relative L2 vs "
        "the float32 reference on the first requests (fp8 rows: on the dequantized cache), checked before timing.",
        "",
    ]
    ran = [r for r in res["rows"] if not not_run(r)]
    kinds = list(dict.fromkeys(r["kind"] for r in res["rows"]))
    for kind in kinds:
        recs = [r for r in ran if r["kind"] == kind]
        if recs:
            lines += _kind_table(kind, recs, anchors)
    lines += _footnote([r for r in res["rows"] if not_run(r)])
    return "\n".join(lines).rstrip("\n") + "\n"


def summary(res: dict) -> str:
    """Compact plain-text table for logs (the markdown file has everything)."""
    c = res.get("ceilings", {})
    anchors = ANCHORS_H200 if "H200" in res["env"].get("device", "") else {}
    lines = [
        f"ceilings: copy {_fmt(c.get('copy_GBps'), 0)} GB/s, matmul {_fmt(c.get('matmul_TFLOPs'), 0)} TFLOP/s"
        + (" (H200 anchors 4248 GB/s, 708 TFLOP/s)" if anchors else "")
    ]
    skipped = [r for r in res["rows"] if not_run(r)]
    for r in res["rows"]:
        if not_run(r):
            continue
        if r.get("ms"):
            fig = f"{r['TFLOPs']:7.1f} TFLOP/s" if r["kind"] == "prefill" else f"{r['GBps']:7.0f} GB/s   "
            vs = f"{r['vs_best_lib']:.2f}x" if r.get("vs_best_lib") else "  -  "
            own = f" own {r['vs_own_lib']:.2f}x" if r.get("vs_own_lib") else ""
            lines.append(
                f"{r['row']:26s} {r['impl']:24s} {r['ms']:9.4f} ms {fig} {vs:>6s}{own} err {r['err']:.1e}"
                + (f"  anchor {anchors[r['row']][r['impl']]}" if r["impl"] in anchors.get(r["row"], {}) else "")
            )
        else:
            lines.append(f"{r['row']:26s} {r['impl']:24s} {_note(r.get('status', ''), 70)}")
    if skipped:
        lines.append(f"({len(skipped)} records not run: n/a or unavailable; the markdown's footnote says why)")
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
        except ImportError as e:  # the JSON/markdown are what matter; say why there is no picture
            _no_png(res, p, f"matplotlib is not installed ({e}); pip install matplotlib, or attnplug's [bench] extra")
        except Exception as e:  # noqa: BLE001 - a broken matplotlib must not lose the measured rows
            _no_png(res, p, f"drawing it failed: {e!r}")
    return paths


def _no_png(res: dict, path: str, why: str) -> None:
    msg = f"attnplug.bench: no plot {path}: {why}"
    if msg not in res.setdefault("warnings", []):
        res["warnings"].append(msg)
        print(msg, file=sys.stderr, flush=True)


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
