"""Cascade (shared-prefix) attention through SGLang on CPU: prompts sharing a 200-token system
prompt hit SGLang's radix cache (the same KV slots), attnplug_triton groups the requests and reads
the shared pages once per decode step; output ids equal SGLang's ``torch_native`` backend, and the
scheduler's marker proves the cascade forwards ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang_helpers import HERE, subprocess_env

from attnplug.tools.tiny_model import shared_prefix_prompts

pytestmark = pytest.mark.sglang

MAX_NEW = 12
PAGE = 16


def test_cascade_equals_torch_native_and_ran(tiny_model, tmp_path):
    prompts = shared_prefix_prompts()
    markers = tmp_path / "markers"
    markers.mkdir()
    runs = [
        {"name": "torch_native", "engine": {"attention_backend": "torch_native", "page_size": PAGE}},
        {
            "name": "cascade",
            "engine": {"attention_backend": "attnplug_triton", "page_size": PAGE},
            "env": {"ATTNPLUG_MARKER_DIR": str(markers), "ATTNPLUG_CASCADE": "always"},
        },
    ]
    spec = {
        "model": str(tiny_model),
        "prompts": prompts,
        "max_new_tokens": MAX_NEW,
        "waves": [[0], list(range(1, len(prompts)))],
        "runs": runs,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_script.py"), str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0 and (tmp_path / "out.json").exists(), (proc.stdout + proc.stderr)[-6000:]
    out = json.loads((tmp_path / "out.json").read_text())
    ours, native = out["cascade"], out["torch_native"]
    assert ours["ok"] and native["ok"], (ours.get("error"), native.get("error"))
    assert ours["output_ids"] == native["output_ids"]
    assert all(c >= 192 for c in ours["cached_tokens"][1:]), ours["cached_tokens"]  # radix-cache hits
    (m,) = [json.loads(p.read_text()) for p in markers.glob("sglang-*.json")]
    assert m["backend"] == "attnplug_triton" and m["provider"] == "triton"
    assert m["cascade_forwards"] >= MAX_NEW - 1, m  # the 4 grouped requests' decode steps
    assert m["cascade_shared_tokens"] >= (len(prompts) - 2) * 192 * (MAX_NEW - 1), m
