"""Issue 17 in SGLang 0.5.23 on CPU, CI versions of two checks (full versions and results:
``python -m attnplug.bench.server_load --engine sglang``, ``python benchmarks/refusal_matrix.py``):

* refusal matrix (§1), the cells of ``refusal_matrix.CI_CELLS`` (~3 min): Gemma2 - logit soft cap and
  sliding window - equal to torch_native through attnplug_triton; attnplug_flashinfer refused on CPU;
* ``sglang.launch_server --attention-backend attnplug_triton`` under load (§5, ~4 min): 32
  concurrent clients, half of them streaming, answered as one by one; faults (a disconnect
  mid-stream, an over-long prompt: HTTP 400, malformed bodies: 4xx) change no other answer and the
  server keeps serving.
"""

from __future__ import annotations

import sys

import pytest
from sglang_helpers import REPO, subprocess_env

pytestmark = pytest.mark.sglang


def test_sglang_refusal_matrix_ci_cells(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from refusal_matrix import ci_problems

    assert not ci_problems("sglang", tmp_path)


def test_sglang_server_attnplug_triton_under_load(tmp_path):
    from attnplug.bench.server_load import problems, serve_and_load
    from attnplug.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    res = serve_and_load("sglang", "attnplug_triton", str(model), tmp_path, 32, env=subprocess_env())
    assert not problems(res), problems(res)
