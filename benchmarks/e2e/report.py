"""Tables from the engine runs of ``engine_run.py`` (one JSON per engine x backend).

    python benchmarks/e2e/report.py RESULTS_DIR --engine vllm --name h200-vllm026-e2e-2026-11-29 \
        --command "bash benchmarks/e2e/device.sh ..." [--logs LANES_LOG_DIR]

Writes benchmarks/results/NAME.json (all runs + derived figures) and NAME.md:
- correctness: per attnplug backend and reference backend, per prompt, the first generated position
  where the greedy tokens differ (``=`` if all 32 agree) and the reference's logprob gap there
  (lp[ref token] - lp[our token]; a gap near 0 is a bf16 near-tie, a large one is a bug);
- speed: output tokens/s per row, each attnplug backend's ratio to the best native backend of the same
  run and to the native Triton backend, against the targets (>= 0.98x best, triton >= 1.05x);
- proof each attnplug backend ran (its ``attnplug: ... active`` log line) when --logs is given.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

NATIVE = {"vllm": ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"], "sglang": ["flashinfer", "triton"]}
NATIVE_TRITON = {"vllm": "TRITON_ATTN", "sglang": "triton"}
REFS = {"vllm": ["FLASH_ATTN", "FLASHINFER"], "sglang": ["flashinfer", "triton"]}


def first_divergence(ours: dict, ref: dict):
    """(position, gap) of the first differing greedy token, or (None, None) when all agree."""
    for i, (a, b) in enumerate(zip(ours["tokens"], ref["tokens"])):
        if a != b:
            top = dict((t, lp) for t, lp in ref["top"][i]) if "top" in ref else {}
            gap = round(top[b] - top[a], 4) if a in top and b in top else None
            return i, gap
    return None, None


def variant(r: dict) -> str:
    """The run's setting besides backend / env / eager / EAGLE: ``""`` (default), e.g. ``-tp2``,
    ``-ngram-repeat``, ``-repeat``, ``-kvfp8``, ``-shared``, ``-shared-n8`` (8 samples a prompt)."""
    kv = r.get("kv_cache_dtype") or "auto"
    return (
        (f"-tp{r['tp']}" if r.get("tp", 1) > 1 else "")
        + ("-ngram" if r.get("spec") == "ngram" else "")
        + ("-repeat" if r.get("prompts") == "repeat" else "")
        + (f"-kv{kv}" if kv != "auto" else "")
        + ("-shared" if r.get("prompts") == "shared" else "")
        + (f"-n{r['samples']}" if r.get("samples", 1) > 1 else "")
    )


def label(r: dict) -> str:
    """Backend and the attnplug environment it ran with, e.g. ``ATTNPLUG_FA3+ATTNPLUG_CASCADE_GRAPHS=1``."""
    return r["backend"] + "".join(f"+{k}={v}" for k, v in sorted((r.get("env") or {}).items()) if k not in TP_ENV_KEYS)


def key(r: dict) -> str:
    return label(r) + variant(r) + ("-eager" if r.get("eager") else "") + ("-eagle" if r.get("eagle") else "")


TP_ENV_KEYS = {
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "VLLM_ALLREDUCE_USE_SYMM_MEM",
    "VLLM_ALLREDUCE_USE_FLASHINFER",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND",
}  # engine_run.TP_ENV, part of -tpN


def best_native(by_backend: dict, natives: list[str], row: str) -> tuple[str, float] | None:
    """``(backend, tok/s)`` of the fastest native run of ``row`` among ``by_backend`` (backend -> run)."""
    tok = {n: by_backend[n]["rows"][row]["tok_s"] for n in natives if row in by_backend[n]["rows"]}
    return max(tok.items(), key=lambda x: x[1]) if tok else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--engine", required=True, choices=["vllm", "sglang"])
    ap.add_argument("--name", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--logs", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    runs = {}
    for p in sorted(glob.glob(os.path.join(a.results, f"{a.engine}-*.json"))):
        r = json.load(open(p))
        r["job"] = os.path.basename(p)[:-5]  # the lane job (and log) of this run
        runs[key(r)] = r
    eng = a.engine
    graph = {k: r for k, r in runs.items() if not r.get("eager") and not r.get("eagle") and not variant(r)}
    ours = [k for k in graph if k.lower().startswith("attnplug")]
    natives = [k for k in NATIVE[eng] if k in graph]
    rows = [row for r in graph.values() for row in r["rows"]]
    rows = list(dict.fromkeys(rows))
    md = [f"# {eng} end to end on the H200: attnplug backends vs the engine's own", "", f"Command: `{a.command}`", ""]
    ver = {r["engine_version"] for r in runs.values()}
    md += [
        f"Engine {eng} {', '.join(sorted(ver))}; Llama-3-8B shape (32 layers, hidden 4096, 32/8 heads, d 128, "
        "vocab 128256) with random N(0, 0.02) weights (benchmarks/e2e/make_model.py), bf16, greedy, "
        "ignore_eos, offline generate; engine defaults (CUDA graphs on"
        + (", torch.compile on" if eng == "vllm" else "")
        + "); max batch 64. tok/s = output tokens / wall time of one generate call on fresh random prompts, "
        "best of the repeats in the JSON; one warm-up of each shape first.",
        "",
    ]
    # speed
    summary = {"speed": {}, "correctness": {}, "targets": {}}
    if rows:
        md += ["## Speed (output tokens/s)", "", "| backend | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
        for k in natives + ours:
            cells = []
            for row in rows:
                v = graph[k]["rows"].get(row, {}).get("tok_s")
                cells.append("-" if v is None else f"{v:.0f}")
            md.append(f"| {k} | " + " | ".join(cells) + " |")
        md += [
            "",
            "Ratios (attnplug / best native of the row; / native triton); target >= 0.98 and triton >= 1.05:",
            "",
            "| backend | " + " | ".join(rows) + " |",
            "|---|" + "---|" * len(rows),
        ]
        for k in ours:
            cells = []
            for row in rows:
                v = graph[k]["rows"].get(row, {}).get("tok_s")
                best = best_native(graph, natives, row)
                if v is None or best is None:
                    cells.append("-")
                    continue
                best_n = best[0]
                r_best = v / best[1]
                ok = r_best >= 0.98
                cell = f"{r_best:.3f} vs {best_n}"
                nt = NATIVE_TRITON[eng]
                if "triton" in k.lower() and row in graph.get(nt, {}).get("rows", {}):
                    r_t = v / graph[nt]["rows"][row]["tok_s"]
                    ok = ok and r_t >= 1.05
                    cell += f"; {r_t:.3f} vs {nt}"
                    summary["speed"].setdefault(k, {})[row] = {
                        "vs_best": round(r_best, 4),
                        "best": best_n,
                        "vs_triton": round(r_t, 4),
                    }
                else:
                    summary["speed"].setdefault(k, {})[row] = {"vs_best": round(r_best, 4), "best": best_n}
                summary["targets"].setdefault(k, {})[row] = ok
                cells.append(cell + (" ✓" if ok else " ✗"))
            md.append(f"| {k} | " + " | ".join(cells) + " |")
        md.append("")
    # correctness
    md += [
        "## Correctness (8 ragged prompts of 37..3000 random tokens, 32 greedy tokens)",
        "",
        "First generated position where the tokens differ from the reference (`=`: all 32 equal), and the "
        "reference's logprob gap between its token and ours there.",
        "",
    ]
    for ref in REFS[eng]:
        if ref not in runs:
            continue
        md += [
            f"Reference: {ref}",
            "",
            "| backend | " + " | ".join(f"p{i}" for i in range(8)) + " | equal |",
            "|---|" + "---|" * 9,
        ]
        for k in [x for x in runs if x != ref]:
            rk = ref + variant(runs[k]) if ref + variant(runs[k]) in runs else ref  # fp8 / TP runs: the native's own
            if "correctness" not in runs[k] or rk == k or (rk != ref and variant(runs[k]) == ""):
                continue
            cells, eq = [], 0
            for o, rr in zip(runs[k]["correctness"], runs[rk]["correctness"]):
                pos, gap = first_divergence(o, rr)
                if pos is None:
                    cells.append("=")
                    eq += 1
                else:
                    cells.append(f"@{pos} (gap {gap})" if gap is not None else f"@{pos} (not in top-5)")
            summary["correctness"].setdefault(ref, {})[k] = cells
            md.append(f"| {k}{'' if rk == ref else f' (vs {rk})'} | " + " | ".join(cells) + f" | {eq}/8 |")
        md.append("")
    # tensor parallel / n-gram / repetitive-prompt variants: each against the native runs of the same variant
    variants = sorted({variant(r) for r in runs.values() if variant(r) and not r.get("eager") and not r.get("eagle")})
    for v in variants:
        vr = {label(r): r for r in runs.values() if variant(r) == v and not r.get("eager") and not r.get("eagle")}
        vref = next((b for b in REFS[eng] if b in vr), None)  # tokens of this variant's runs vs its native
        nat = [b for b in NATIVE[eng] if b in vr]
        vrows = list(dict.fromkeys(row for r in vr.values() for row in r["rows"]))
        md += [
            f"## Variant `{v}` ("
            + ", ".join(
                filter(
                    None,
                    [
                        f"tensor parallel {v.split('-tp')[1].split('-')[0]} GPUs" if "-tp" in v else "",
                        "n-gram speculation (accepted = tokens per verify step, bonus included)"
                        if "-ngram" in v
                        else "",
                        "prompts repeating a 32-token phrase" if "-repeat" in v else "",
                        f"KV cache {v.split('-kv')[1].split('-')[0]} "
                        "(KV = capacity in tokens vs the same backend's default run)"
                        if "-kv" in v
                        else "",
                        "64 requests sharing an 8192-token system prompt, prefix cache warm "
                        "(cascade = attnplug forwards that "
                        "read the shared prefix once)"
                        if "-shared" in v and not re.search(r"-n\d", v)
                        else "",
                        f"{v.split('-n')[-1]} samples of each prompt (parallel sampling, top-k 1), prefix cache warm"
                        if re.search(r"-n\d", v)
                        else "",
                    ],
                )
            )
            + ")",
            "",
            "| backend | " + " | ".join(vrows) + " |",
            "|---|" + "---|" * len(vrows),
        ]
        for b in nat + [b for b in vr if b not in nat]:
            cells = []
            for row in vrows:
                x = vr[b]["rows"].get(row)
                if x is None:
                    cells.append("-")
                    continue
                cell = f"{x['tok_s']:.0f}"
                best = best_native(vr, nat, row)
                if b not in nat and best:
                    cell += f" ({x['tok_s'] / best[1]:.3f} vs {best[0]})"
                    summary["targets"].setdefault(b + v, {})[row] = x["tok_s"] / best[1] >= 0.98
                if "accepted_per_step" in x:
                    cell += f", accepted {x['accepted_per_step']}"
                base = runs.get(b + v.replace("-ngram", "")) if "-ngram" in v else None
                if base and row in base["rows"]:
                    cell += f", {x['tok_s'] / base['rows'][row]['tok_s']:.2f}x without speculation"
                plain, cap = runs.get(b), vr[b].get("kv_capacity_tokens")
                if "-kv" in v and cap and plain and plain.get("kv_capacity_tokens"):
                    cell += f", KV {cap / plain['kv_capacity_tokens']:.2f}x"
                marks = vr[b].get("markers") or []
                casc = sum(m.get("cascade_forwards", 0) for m in marks)
                gcasc = sum(m.get("cascade_graph_updates", 0) for m in marks)
                if b not in nat and marks:  # the proof markers: forwards / graph replays that read a prefix once
                    cell += f", cascade {casc} eager + {gcasc} graph forwards"
                    off = "0" in (vr[b].get("env") or {}).get("ATTNPLUG_CASCADE", "1") + (vr[b].get("env") or {}).get(
                        "ATTNPLUG_CASCADE_GRAPHS", "1"
                    )  # turned off on purpose
                    if ("-shared" in v or re.search(r"-n\d", v)) and casc + gcasc == 0 and not off:  # a harness bug
                        cell += " (NO CASCADE RAN)"
                # the variant's own prompts where the run has them (shared: 8 requests on the cached prefix)
                ck = "shared_correctness" if vr[b].get("shared_correctness") else "correctness"
                if vref and b != vref and vr[b].get(ck) and vr[vref].get(ck):
                    divs = [first_divergence(o, rr) for o, rr in zip(vr[b][ck], vr[vref][ck])]
                    eq = sum(p is None for p, _ in divs)
                    gaps = ", ".join(f"@{p} gap {g}" for p, g in divs if p is not None)
                    what = "shared-prefix prompts" if ck == "shared_correctness" else "prompts"
                    cell += f"; tokens vs {vref}: {eq}/{len(divs)} {what} equal" + (f" ({gaps})" if gaps else "")
                cells.append(cell)
            md.append(f"| {b} | " + " | ".join(cells) + " |")
        md.append("")
    # eager vs graphs, EAGLE
    extra = [k for k in runs if runs[k].get("eager") or runs[k].get("eagle")]
    if extra:
        md += [
            "## Eager (no CUDA graphs) and EAGLE runs",
            "",
            "| run | init s | rows (tok/s) | note |",
            "|---|---|---|---|",
        ]
        for k in extra:
            r = runs[k]
            note = ""
            if r.get("eagle"):
                vc = [o.get("spec_verify_ct") for o in r["correctness"]]
                acc = [x["accepted_per_step"] for x in r["rows"].values() if "accepted_per_step" in x]
                if acc:
                    note = f"accepted tokens/verify step {acc[0]}; "
                elif all(v for v in vc):
                    accepted = sum(len(o["tokens"]) for o in r["correctness"]) / sum(vc)
                    note = f"mean accepted tokens/verify step {accepted:.2f}; "
                base = graph.get(r["backend"])
                if base:
                    same = sum(o["tokens"] == b["tokens"] for o, b in zip(r["correctness"], base["correctness"]))
                    note += f"{same}/8 prompts token-identical to {r['backend']} without EAGLE"
            elif r["backend"] in graph:
                g = graph[r["backend"]]["rows"]
                note = "graph/eager: " + ", ".join(
                    f"{row} {g[row]['tok_s'] / v['tok_s']:.2f}x" for row, v in r["rows"].items() if row in g
                )
            md.append(
                f"| {k} | {r['init_s']} | "
                + ", ".join(f"{row}: {v['tok_s']:.0f}" for row, v in r["rows"].items())
                + f" | {note} |"
            )
        md.append("")
    if a.logs:
        md += ["## Proof each attnplug run used attnplug (its own log: the backend's `active` line, graph capture)", ""]
        for k, r in runs.items():
            if not k.lower().startswith("attnplug"):
                continue
            log = os.path.join(a.logs, r["job"] + ".log")
            lines = open(log, errors="replace").read().splitlines() if os.path.exists(log) else []
            active = [x.strip() for x in lines if "attnplug:" in x and " active (" in x]
            graphs = [
                x.strip()
                for x in lines
                if "Graph capturing finished" in x
                or "cudagraph_mode=" in x
                or ("Capture " in x and "CUDA graph end" in x)
            ]
            md.append(f"- {k}: `{active[0][-170:]}`" if active else f"- {k}: NO 'active' line in {r['job']}.log")
            for g in graphs[:4]:
                md.append(f"  - `{g[-170:]}`")
        md.append("")
    os.makedirs(a.out, exist_ok=True)
    json.dump(
        {"runs": runs, "summary": summary, "command": a.command},
        open(os.path.join(a.out, a.name + ".json"), "w"),
        indent=1,
    )
    open(os.path.join(a.out, a.name + ".md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
