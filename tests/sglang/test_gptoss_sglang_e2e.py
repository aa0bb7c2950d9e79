"""End to end on CPU (issue 41): SGLang 0.5.23 serves a tiny gpt-oss (``GptOssForCausalLM``: attention
sinks, layers alternating a 16-token sliding window and full attention, MoE) through ``attnplug_triton``
and through its own ``triton`` backend (Triton interpreter). attnplug's greedy tokens equal the HF
transformers eager forward of the same weights (float32) on every prompt; SGLang's triton backend equals
them on the prompt that stays inside the window and differs on the longer ones (its decode window is one
key short of its extend window; see the test). The sinks are scaled up (and held in bf16, SGLang's
gpt-oss dtype for them) so that they change the greedy tokens; markers prove attnplug ran with a
windowed and a full layer config, each with sinks, and that SGLang's run did not touch attnplug."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang_helpers import HERE, subprocess_env

pytestmark = pytest.mark.sglang

MAX_NEW = 8
WINDOW = 16  # config.sliding_window; SGLang's sliding_window_size (the core's window_left) is 15
WAVES = [[0, 1, 3], [2]]  # prompt 2 shares 96 tokens (+BOS) with prompt 1: a cached prefix > the window


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from attnplug.tools.tiny_model import make_tiny_gptoss, test_prompts

    tmp = tmp_path_factory.mktemp("gptoss")
    model = make_tiny_gptoss(tmp / "tiny-gpt-oss", sink_dtype="bfloat16")
    prompts = test_prompts()[:4]
    markers = {n: tmp / f"markers-{n}" for n in ("attnplug", "triton")}
    for d in markers.values():
        d.mkdir()
    # attnplug first: it must switch the Triton interpreter on by itself; SGLang's triton backend needs
    # it set by hand on CPU (the env persists into the later run)
    spec = {
        "model": str(model),
        "prompts": prompts,
        "max_new_tokens": MAX_NEW,
        "waves": WAVES,
        "runs": [
            {
                "name": "attnplug",
                "engine": {"attention_backend": "attnplug_triton"},
                "env": {"ATTNPLUG_MARKER_DIR": str(markers["attnplug"])},
            },
            {
                "name": "triton",
                "engine": {"attention_backend": "triton"},
                "env": {"ATTNPLUG_MARKER_DIR": str(markers["triton"]), "TRITON_INTERPRET": "1"},
            },
        ],
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_script.py"), str(tmp / "spec.json"), str(tmp / "out.json")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (tmp / "out.json").exists(), log[-6000:]
    out = json.loads((tmp / "out.json").read_text())
    found = {n: [json.loads(p.read_text()) for p in d.glob("sglang-*.json")] for n, d in markers.items()}
    return model, prompts, out, found, log


def test_gptoss_tokens_equal_sglang_triton_and_hf_and_attnplug_ran(runs):
    from attnplug.tools.tiny_model import hf_greedy_eager

    model, prompts, out, markers, log = runs
    ours, native = out["attnplug"], out["triton"]
    assert ours["ok"], ours.get("error")
    assert native["ok"], native.get("error")
    hf = hf_greedy_eager(model, prompts, MAX_NEW)
    assert hf != hf_greedy_eager(model, prompts, MAX_NEW, drop_sinks=True), "the sinks must change the tokens"
    assert ours["output_ids"] == hf  # every prompt, past the window and through the prefix cache
    # SGLang's triton backend equals both while a sequence fits in the window (prompt 0: 7 + 8 tokens); on
    # the longer ones it differs from HF's float32 eager forward: its decode reads the last
    # min(seq_len, sliding_window_size) = 15 keys of a windowed layer (update_sliding_window_buffer), its
    # extend kernel and HF 16 (q - k <= 15); attnplug and vLLM's CPU backend agree with HF
    # (tests/vllm/test_vllm_gptoss_e2e.py)
    short = [i for i, p in enumerate(prompts) if len(p) + MAX_NEW <= WINDOW]
    assert short == [0] and native["output_ids"][0] == ours["output_ids"][0]
    print(
        "SGLang triton vs HF, prompts past the window:",
        [native["output_ids"][i] == hf[i] for i in range(1, len(prompts))],
    )
    assert ours["cached_tokens"][2] == 97  # the shared prefix (+BOS) came from the radix cache
    # attnplug admitted by SGLang's gpt-oss check, KV in one plain pool; SGLang's own run kept its SWA pool
    assert "attnplug: GptOssForCausalLM's attention-backend check admits attnplug_triton" in log
    assert "attnplug: GptOssForCausalLM keeps its KV in one plain pool with attnplug_triton" in log
    assert "SWAKVPool mem usage" in log
    (m,) = markers["attnplug"]
    assert (m["backend"], m["provider"], m["triton_interpret"]) == ("attnplug_triton", "triton", "1"), m
    assert m["layer_configs"] == ["window -1, sinks True", f"window {WINDOW - 1}, sinks True"], m
    assert m["forwards"] == {"EXTEND": len(WAVES), "DECODE": len(WAVES) * (MAX_NEW - 1)}, m
    assert m["layer_runs"] == 2 * (sum(m["forwards"].values()) - 1) and m["max_cached_prefix"] > WINDOW, m
    assert markers["triton"] == []  # SGLang's own backend ran there, attnplug did not
