"""README's charts, drawn from the committed H200 results in benchmarks/results/.

    python scripts/make_charts.py [--out docs/img]      (needs matplotlib: pip install '.[bench]')

Writes
  which-backend.png  end to end, output tokens/s of each attnplug backend relative to the engine's best
                     native backend, per row (vLLM 0.26 vs FLASH_ATTN, SGLang 0.5.17 vs flashinfer);
  wins.png           where attnplug is faster: 64 requests sharing an 8192-token prompt end to end
                     (cascade in decode CUDA graphs), and kernel ratios to the best library kernel of the
                     row (tree verify, shared-prefix decode, fp8-KV decode as CUDA-graph replays).
and prints every plotted number with the file it comes from (docs/performance.md cites the same files).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"
E2E = {
    "vLLM 0.26 (vs FLASH_ATTN)": ("h200-vllm026-e2e-2026-11-30.json", "FLASH_ATTN"),
    "SGLang 0.5.17 (vs flashinfer)": ("h200-sglang0517-e2e-2026-11-30.json", "flashinfer"),
}
SHARED = {
    "vLLM 0.26": "h200-vllm026-e2e-shared-2026-12-01.json",
    "SGLang 0.5.17": "h200-sglang0517-e2e-shared-2026-12-02.json",
}
KERNEL_JSON = "h200-bench-2026-12-01.json"  # eager timings: tree verify, shared-prefix decode
FP8_MD = "h200-bench-fp8-pairs-graphs-2026-12-03c.md"  # CUDA-graph replays (the run's JSON is in git history)
LIB_NAMES = {
    "flashinfer.prefill_fa2": "FlashInfer",
    "flashinfer.prefill_fa3": "FlashInfer",
    "flashinfer.decode_tc": "FlashInfer",
    "flashinfer.cascade": "FlashInfer's cascade",
    "fa3.paged": "FA3",
}
COLORS = {
    "attnplug_fa3": "#1f77b4",
    "attnplug_flashinfer": "#2ca02c",
    "attnplug_triton": "#d62728",
    "native": "#7f7f7f",
}


def _runs(name: str) -> dict[str, dict]:
    """label -> run of an e2e JSON (benchmarks/e2e/report.py): engine backend, env, rows {row: {tok_s}}."""
    return json.loads((RES / name).read_text())["runs"]


def _label(run: dict) -> str:
    """attnplug's backend as a user names it (the flashinfer device replay is its default now)."""
    b = run["backend"].lower()
    return b if b.startswith("attnplug_") else "native"


def e2e_ratios() -> dict[str, dict[str, list[float]]]:
    """panel -> backend -> [ratio per row] and panel -> '_rows' -> row names."""
    out = {}
    for panel, (name, best) in E2E.items():
        runs = _runs(name)
        base = next(r for r in runs.values() if r["backend"] == best and not r.get("env"))
        rows = list(base["rows"])
        panel_out = {"_rows": rows}
        for run in runs.values():
            label = _label(run)
            if label == "native":
                continue
            if label == "attnplug_flashinfer" and run.get("env", {}).get("ATTNPLUG_FLASHINFER_DEVICE_REPLAY") != "1":
                continue  # the host-replay run of before the default changed
            panel_out[label] = [run["rows"][r]["tok_s"] / base["rows"][r]["tok_s"] for r in rows]
            print(f"{panel:32s} {label:22s} " + " ".join(f"{x:.2f}" for x in panel_out[label]) + f"  ({name})")
        out[panel] = panel_out
    return out


def shared_tok_s() -> dict[str, list[tuple[str, float]]]:
    """engine -> [(bar label, output tok/s)] on the shared-prefix row (64 x 8192 shared + 256 -> 256)."""
    out = {}
    for engine, name in SHARED.items():
        bars = []
        for run in _runs(name).values():
            cg = run.get("env", {}).get("ATTNPLUG_CASCADE_GRAPHS") == "1"
            label = run["backend"].lower() + (" + cascade graphs" if cg else "")
            bars.append((label, next(iter(run["rows"].values()))["tok_s"]))
        bars.sort(key=lambda b: b[1])
        for label, v in bars:
            print(f"shared prefix {engine:14s} {label:38s} {v:7.0f} tok/s  ({name})")
        out[engine] = bars
    return out


def _md_rows(name: str) -> list[dict]:
    """The records of a ``python -m attnplug.bench`` markdown table: row, impl, ms."""
    recs = []
    for line in (RES / name).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 3 and re.fullmatch(r"[0-9.]+", cells[2]):
            recs.append({"row": cells[0], "impl": cells[1], "ms": float(cells[2])})
    return recs


def kernel_ratios() -> list[tuple[str, str, float]]:
    """[(row label, attnplug implementation, library ms / attnplug ms)] against the best library kernel."""
    out = []

    def add(recs, row, label, libs, impls, source):
        ms = {r["impl"]: r["ms"] for r in recs if r["row"] == row and r.get("ms")}
        lib = min(ms[x] for x in libs if x in ms)
        best = min(libs, key=lambda x: ms.get(x, float("inf")))
        for impl in impls:
            out.append(
                (f"{label}\nvs {LIB_NAMES.get(best, best)}", impl.replace("attnplug.", "attnplug_"), lib / ms[impl])
            )
            print(f"kernel {row:30s} {impl:20s} {lib / ms[impl]:.2f}x {best}  ({source})")

    recs = json.loads((RES / KERNEL_JSON).read_text())["rows"]
    libs = (
        "flashinfer.decode_tc",
        "flashinfer.prefill_fa2",
        "flashinfer.prefill_fa3",
        "flashinfer.cascade",
        "fa3.paged",
    )
    add(
        recs,
        "verify 32x(4096+64 tree)",
        "tree verify 32x(4096+64)",
        libs,
        ("attnplug.fa3", "attnplug.triton"),
        KERNEL_JSON,
    )
    add(
        recs,
        "cascade decode 64x(8192+256)",
        "shared prefix 64x(8192+256)",
        libs,
        ("attnplug.fa3", "attnplug.triton"),
        KERNEL_JSON,
    )
    fp8 = _md_rows(FP8_MD)
    for row in ("decode 64x4096 fp8", "decode 1x32768 fp8"):
        add(
            fp8,
            row,
            f"fp8 KV decode {row.split()[1]}",
            ("fa3.paged", "flashinfer.decode_tc"),
            ("attnplug.triton",),
            FP8_MD,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python scripts/make_charts.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    plt.rcParams.update(
        {"font.size": 9, "svg.hashsalt": "attnplug", "axes.spines.top": False, "axes.spines.right": False}
    )

    ratios = e2e_ratios()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, (panel, data) in zip(axes, ratios.items()):
        rows = data["_rows"]
        names = [n for n in ("attnplug_fa3", "attnplug_flashinfer", "attnplug_triton") if n in data]
        w = 0.8 / len(names)
        for j, n in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * w for i in range(len(rows))]
            ax.bar(xs, data[n], w, label=n, color=COLORS[n])
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)), [r.replace("->", "→") for r in rows])
        ax.set_ylim(0.6, 1.1)
        ax.set_title(panel)
        ax.set_xlabel("requests x prompt tokens → new tokens")
    axes[0].set_ylabel("output tok/s relative to the native backend")
    axes[0].legend(loc="lower left", frameon=False)
    fig.suptitle("End to end on one H200 (Llama-3-8B shape, bf16, CUDA graphs): 1.0 = the engine's best backend")
    fig.tight_layout()
    fig.savefig(args.out / "which-backend.png", dpi=110, metadata={"Software": None})
    plt.close(fig)

    shared = shared_tok_s()
    kern = kernel_ratios()
    fig = plt.figure(figsize=(12, 7))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.1])
    for k, (engine, bars) in enumerate(shared.items()):
        ax = fig.add_subplot(grid[0, k])
        labels = [b[0] if b[0].startswith("attnplug") else f"{b[0]} (native)" for b in bars]
        colors = [COLORS.get(lab.split(" ")[0], COLORS["native"]) for lab in labels]
        ax.barh(range(len(bars)), [b[1] for b in bars], color=colors)
        ax.set_yticks(range(len(bars)), labels, fontsize=8)
        for i, (_, v) in enumerate(bars):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
        ax.set_xlabel("output tok/s (256 new tokens each)")
        ax.set_title(f"{engine}: 64 requests, one 8192-token prefix", fontsize=9)
        ax.set_xlim(0, max(b[1] for b in bars) * 1.18)
    ax = fig.add_subplot(grid[1, :])
    labels = [f"{row.splitlines()[0]}: {impl} ({row.splitlines()[-1]})" for row, impl, _ in kern]
    ax.barh(range(len(kern)), [r for _, _, r in kern], color=[COLORS[i] for _, i, _ in kern])
    ax.set_yticks(range(len(kern)), labels, fontsize=8)
    for i, (_, _, r) in enumerate(kern):
        ax.text(r, i, f" {r:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.invert_yaxis()
    ax.set_xlim(0, max(r for _, _, r in kern) * 1.12)
    ax.set_xlabel("kernel speed relative to the best library kernel of the row (1.0 = as fast)")
    ax.set_title("Kernels: one layer of Llama-3-8B attention (32/8 heads, d128, page 16)")
    fig.suptitle("Where attnplug is faster on the H200: shared prefixes (cascade), tree verify, fp8-KV decode")
    fig.tight_layout()
    fig.savefig(args.out / "wins.png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {args.out / 'which-backend.png'}, {args.out / 'wins.png'}")


if __name__ == "__main__":
    main()
