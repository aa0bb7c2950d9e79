"""Cascade with default settings (no attnplug variable but the marker folder) through SGLang on CPU: a
shared-prefix prompt set and an ``n = 4`` sampling request (top-k 1, so every sample is the greedy one)
over a cached prompt. The tiny Llama has one layer with wide KV heads (16 x 256, float32: 512 KiB a page of 16 tokens),
so 4 requests on a 448-token prefix clear the cost model's bound (3 x 28 pages x 512 KiB = 42 MiB a layer
>= :data:`attnplug.core.cascade.MIN_SAVED_BYTES`) as a long system prompt does on a real model. Output
ids equal SGLang's ``torch_native`` backend and the scheduler's marker proves the cascade forwards ran
(on CPU SGLang runs no CUDA graphs: the eager cascade path, on by default)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang_helpers import HERE, subprocess_env

from attnplug.tools.tiny_model import make_tiny_llama, shared_prefix_prompts

pytestmark = pytest.mark.sglang

SHARED, MAX_NEW, N, PAGE = 448, 4, 4, 16
WIDE_KV = dict(num_attention_heads=16, num_key_value_heads=16, head_dim=256, num_hidden_layers=1)


def test_defaults_give_native_ids_and_read_shared_prefixes_once(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny-llama-wide-kv", **WIDE_KV)
    prompts = shared_prefix_prompts(n=5, shared=SHARED)
    markers = tmp_path / "markers"
    markers.mkdir()
    runs = [
        {"name": "torch_native", "engine": {"attention_backend": "torch_native", "page_size": PAGE}},
        {
            "name": "defaults",
            "engine": {"attention_backend": "attnplug_triton", "page_size": PAGE},
            "env": {"ATTNPLUG_MARKER_DIR": str(markers)},
        },
    ]
    waves = [[0], [1, 2, 3, 4], {"prompts": [0], "sampling": {"n": N, "temperature": 1.0, "top_k": 1}}]
    spec = {"model": str(model), "prompts": prompts, "max_new_tokens": MAX_NEW, "waves": waves, "runs": runs}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("ATTNPLUG_")}  # defaults
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_script.py"), str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and (tmp_path / "out.json").exists(), (proc.stdout + proc.stderr)[-6000:]
    out = json.loads((tmp_path / "out.json").read_text())
    ours, native = out["defaults"], out["torch_native"]
    assert ours["ok"] and native["ok"], (ours.get("error"), native.get("error"))
    assert ours["output_ids"] == native["output_ids"]
    assert ours["samples"]["0"] == native["samples"]["0"] and len(ours["samples"]["0"]) == N
    assert all(s == ours["output_ids"][0] for s in ours["samples"]["0"]), "top-k 1 samples are greedy"
    assert all(c >= SHARED - PAGE for c in ours["cached_tokens"][1:]), ours["cached_tokens"]  # radix-cache hits
    (m,) = [json.loads(p.read_text()) for p in markers.glob("sglang-*.json")]
    assert m["backend"] == "attnplug_triton" and m["provider"] == "triton"
    # the decode steps of the 4 grouped requests and of the 4 samples read their shared prefix once
    assert m["cascade_forwards"] >= 2 * (MAX_NEW - 1), m
    assert m["cascade_shared_tokens"] >= m["cascade_forwards"] * 3 * (SHARED - PAGE), m
