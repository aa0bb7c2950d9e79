"""End to end on CPU: vLLM generates through attnplug (``LLM`` API and ``vllm serve`` + HTTP).

Oracles: vLLM's own CPU backend and an HF transformers forward of the same weights (float32,
greedy). Engines run in subprocesses, concurrently, once per module (~1 min per start here).
"""

from __future__ import annotations

import os
import shutil

import pytest

from attnplug.tiny_model import hf_greedy
from vllm_test_helpers import (
    BROKEN_LIBS,
    CORE_PROVIDER,
    MAX_TOKENS,
    REPO,
    llm_job,
    read_markers,
    run_jobs,
    subprocess_env,
    workdir,
)

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

ACTIVE = f"attnplug: ATTNPLUG_TRITON active (provider {CORE_PROVIDER}, layout NHD, page 16"


@pytest.fixture(scope="module")
def setup():
    from attnplug.tiny_model import make_tiny_llama, test_prompts

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
    from attnplug.tiny_model import make_tiny_eagle_draft

    wd, model, prompts = setup
    draft = str(make_tiny_eagle_draft(wd / "tiny-eagle", model))
    eagle = dict(method="eagle", model=draft, num_speculative_tokens=2)
    specs = {
        # cascade off: single-token decodes then run on the CUDA-graph static buffers (on CPU too);
        # with cascade on they plan eagerly (test_vllm_cascade_e2e.py)
        "attnplug": (llm_job(model, prompts, "attnplug_triton", 16), {"ATTNPLUG_CASCADE": "0"}),
        # EAGLE: vLLM picks the drafter's backend separately (speculative_config.attention_backend)
        "eagle": (llm_job(model, prompts, "attnplug_triton", 16,
                          speculative_config={**eagle, "attention_backend": "ATTNPLUG_TRITON"}), {}),
        "native_eagle": (llm_job(model, prompts, None, 32, speculative_config=eagle), {}),
        "native": (llm_job(model, prompts, None, 32), {"PYTHONPATH": f"{BROKEN_LIBS}{os.pathsep}{REPO}"}),
        "no_plugin": (llm_job(model, prompts, None, 32), {"VLLM_PLUGINS": ""}),
        "flashinfer": (llm_job(model, prompts, "attnplug_flashinfer", 16), {}),
    }
    return run_jobs(wd, specs)


@pytest.fixture(scope="module")
def served(setup):
    """``vllm serve --attention-backend attnplug_triton`` (spawns EngineCore + worker) and one
    HTTP completion per prompt, in order (prompt 2 then hits the prefix cached by prompt 1)."""
    from attnplug.demo_vllm import VllmServer

    wd, model, prompts = setup
    env = {k: v for k, v in subprocess_env(ATTNPLUG_MARKER_DIR=str(wd / "serve-markers")).items()}
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
    assert "set TRITON_INTERPRET=1" in ours.output  # done by attnplug, not by the test env
    assert "Cannot use" not in ours.output  # vLLM's CPU fallback message
    (m,) = ours.markers  # one worker
    assert m["backends"]["ATTNPLUG_TRITON"][0].startswith(f"provider {CORE_PROVIDER}, layout NHD, page 16")
    assert m["layer_runs"] >= 2 * MAX_TOKENS and m["kv_writes"] == m["layer_runs"]
    if CORE_PROVIDER == "triton":  # decode steps ran on the CUDA-graph static buffers (eagerly: CPU captures nothing)
        assert m["graph_builds"] >= MAX_TOKENS, m
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


def test_flashinfer_refused_on_cpu_with_install_hint(runs):
    r = runs["flashinfer"]
    assert r.returncode != 0 and r.results is None
    assert "attnplug: backend ATTNPLUG_FLASHINFER cannot start on cpu" in r.output, r.output[-4000:]
    assert "pip install flashinfer-python" in r.output
    assert r.markers == []


def test_vllm_serve_attnplug_triton_http(served, hf_tokens):
    tokens, log, markers = served
    assert tokens == hf_tokens
    active = [line for line in log.splitlines() if ACTIVE in line]
    assert active and all("Worker pid=" in line for line in active), log[-4000:]
    (m,) = markers
    assert m["layer_runs"] > 0 and m["prefix_hit_requests"] >= 1 and m["max_cached_prefix"] >= 96
