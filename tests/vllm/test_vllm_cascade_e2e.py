"""Cascade (shared-prefix) attention through vLLM on CPU: requests whose prompts share a 200-token
system prompt hit vLLM's prefix cache (the same KV blocks), attnplug_triton groups them and reads
the shared blocks once per decode step; tokens equal vLLM's own CPU backend, and the worker's
markers prove the cascade forwards ran."""

from __future__ import annotations

import pytest
from vllm_test_helpers import MAX_TOKENS, in_process, run_jobs, workdir

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def cascade_runs():
    from attnplug.tools.tiny_model import make_tiny_llama, shared_prefix_prompts

    wd = workdir()
    model = str(make_tiny_llama(wd / "tiny-llama"))
    prompts = shared_prefix_prompts()

    def job(backend, block):  # prompt 0 first (it fills the prefix cache), then the others together
        return dict(
            model=model,
            prompts=prompts,
            backend=backend,
            block_size=block,
            max_tokens=MAX_TOKENS,
            batches=[[0], list(range(1, len(prompts)))],
        )

    # "cascade": eager cascade alone (graph cascade off: decode batches plan eagerly); "cascade_graphs": graph
    # cascade opted in (ATTNPLUG_CASCADE_GRAPHS=1), forced to cut (ATTNPLUG_CASCADE=always) on this tiny model
    specs = {
        "cascade": (job("attnplug_triton", 16), {"ATTNPLUG_CASCADE": "always", "ATTNPLUG_CASCADE_GRAPHS": "0"}),
        "cascade_graphs": (job("attnplug_triton", 16), {"ATTNPLUG_CASCADE": "always", "ATTNPLUG_CASCADE_GRAPHS": "1"}),
        "native": in_process(job(None, 32), {}),
    }
    return prompts, run_jobs(wd, specs)


def test_cascade_tokens_equal_native_and_cascade_ran(cascade_runs):
    prompts, runs = cascade_runs
    ours, native = runs["cascade"].check_ok(), runs["native"].check_ok()
    for i in range(len(prompts)):
        assert ours.results[i]["token_ids"] == native.results[i]["token_ids"], i
    assert all(ours.results[i]["num_cached_tokens"] >= 192 for i in range(1, len(prompts)))  # prefix-cache hits
    (m,) = [m for m in ours.markers if m["layer_runs"]]
    assert "cascade always" in " ".join(m["backends"]["ATTNPLUG_TRITON"])
    # every decode step of the 4 grouped requests, and the extends of their prompts' own tokens
    assert m["cascade_forwards"] >= MAX_TOKENS - 1, m
    assert m["cascade_shared_tokens"] >= (len(prompts) - 2) * 192 * (MAX_TOKENS - 1), m


def test_cascade_in_decode_graph_buffers_equals_native_and_is_counted(cascade_runs):
    """Graph cascade (``ATTNPLUG_CASCADE_GRAPHS=1``): the decode steps run on the CUDA-graph static buffers (on CPU the
    same launches, uncaptured), whose update cuts the pages every request of the batch shares (on
    the device, from vLLM's block table); tokens equal vLLM's own backend and the markers count
    those steps (``cascade_graph_updates``)."""
    prompts, runs = cascade_runs
    ours, native = runs["cascade_graphs"].check_ok(), runs["native"].check_ok()
    for i in range(len(prompts)):
        assert ours.results[i]["token_ids"] == native.results[i]["token_ids"], i
    (m,) = [m for m in ours.markers if m["layer_runs"]]
    assert "in CUDA graphs on" in " ".join(m["backends"]["ATTNPLUG_TRITON"]), m
    assert m["graph_builds"] >= 2 * (MAX_TOKENS - 1), m  # both batches' decode steps on the graph buffers
    # the 4 grouped requests' decode steps cut their 12 common blocks (192 of the 200 shared tokens)
    assert m["cascade_graph_updates"] >= MAX_TOKENS - 2, m
    assert m["cascade_graph_shared_tokens"] >= 192 * (MAX_TOKENS - 2), m
    assert (
        m["cascade_graph_shared_tokens"] % 16 == 0
        and m["cascade_graph_shared_tokens"] <= 192 * m["cascade_graph_updates"]
    ), m
