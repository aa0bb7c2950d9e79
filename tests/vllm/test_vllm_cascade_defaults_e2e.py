"""Cascade with default settings (no attnplug variable set) through vLLM on CPU: a shared-prefix prompt set
and an ``n = 4`` sampling request over a cached prompt. The tiny Llama here has one layer with wide KV
heads (16 x 256, float32: 512 KiB a page of 16 tokens), so 3 requests re-reading a 448-token prefix clear the
cost model's bound (:data:`attnplug.core.cascade.MIN_SAVED_BYTES` a layer) as a long system prompt does on a
real model (4 requests on the shared prompt: 3 x 28 pages x 512 KiB = 42 MiB). Tokens equal vLLM's own CPU backend; the
markers prove the shared pages were read once in the eager forwards (the extend of the 4 prompts over the
cached prefix), and that decode graphs did not cut (cascade in CUDA graphs is opt-in:
``test_vllm_cascade_e2e.py`` runs it)."""

from __future__ import annotations

import pytest
from vllm_test_helpers import in_process, run_jobs, workdir

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

SHARED, MAX_TOKENS, N = 448, 4, 4
WIDE_KV = dict(num_attention_heads=16, num_key_value_heads=16, head_dim=256, num_hidden_layers=1)


@pytest.fixture(scope="module")
def default_runs():
    from attnplug.tools.tiny_model import make_tiny_llama, shared_prefix_prompts

    wd = workdir()
    model = str(make_tiny_llama(wd / "tiny-llama-wide-kv", **WIDE_KV))
    prompts = shared_prefix_prompts(n=5, shared=SHARED)
    # prompt 0 first (it fills the prefix cache), then the others together, then prompt 0 again with
    # n = 4 samples (top_k = 1: every sample is the greedy one, so tokens can be compared)
    batches = [[0], [1, 2, 3, 4], {"prompts": [0], "sampling": dict(n=N, temperature=1.0, top_k=1, seed=0)}]

    def job(backend, block):
        return dict(
            model=model, prompts=prompts, backend=backend, block_size=block, max_tokens=MAX_TOKENS, batches=batches
        )

    defaults = {k: None for k in ("ATTNPLUG_CASCADE", "ATTNPLUG_CASCADE_GRAPHS", "ATTNPLUG_GRAPH_IF", "ATTNPLUG_PDL")}
    return prompts, run_jobs(
        wd, {"defaults": (job("attnplug_triton", 16), defaults), "native": in_process(job(None, 32), {})}
    )


def _check_tokens(ours, native, prompts):
    for i in range(len(prompts)):
        assert ours.results[i]["token_ids"] == native.results[i]["token_ids"], i
    assert ours.samples["0"] == native.samples["0"] and len(ours.samples["0"]) == N
    assert all(s == ours.results[0]["token_ids"] for s in ours.samples["0"]), "top_k = 1 samples are greedy"
    assert all(ours.results[i]["num_cached_tokens"] >= SHARED - 16 for i in (1, 2, 3, 4))  # prefix-cache hits
    (m,) = [m for m in ours.markers if m["layer_runs"]]
    return m, " ".join(m["backends"]["ATTNPLUG_TRITON"])


def test_defaults_give_native_tokens_and_read_shared_prefixes_once_in_eager_forwards(default_runs):
    prompts, runs = default_runs
    m, line = _check_tokens(runs["defaults"].check_ok(), runs["native"].check_ok(), prompts)
    assert "cascade auto" in line and "in CUDA graphs off" in line, line
    assert m["cascade_forwards"] >= 1 and m["cascade_shared_tokens"] >= SHARED - 16, m  # the extend of 1..4
    assert m["cascade_graph_updates"] == 0, m
