"""Issue 41 (SGLang 0.5.17 and 0.5.23): SGLang's gpt-oss check (``GptOssForCausalLM requires one of
['triton', 'trtllm_mha', 'fa3', ...]``) admits an attnplug backend only through attnplug's hook, and only
when one is selected; the model then keeps its KV in one plain pool (SGLang's own ``ModelConfig``
decides ``is_hybrid_swa``). Runs SGLang's real argument resolution on a tiny gpt-oss config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang_helpers import HERE, subprocess_env

pytestmark = pytest.mark.sglang

REFUSAL = "AssertionError: GptOssForCausalLM requires one of ['triton', 'trtllm_mha', 'fa3'"


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    from attnplug.tools.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("gptoss") / "tiny-gpt-oss", "gpt_oss")
    r = subprocess.run(
        [sys.executable, str(HERE / "gptoss_resolve_script.py"), str(model)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), r.stdout + r.stderr


def test_sglang_refuses_attnplug_for_gptoss_without_the_hook(resolved):
    out, _ = resolved
    assert out["no_hook"]["error"].startswith(REFUSAL) and "Prefill: attnplug_triton" in out["no_hook"]["error"]


@pytest.mark.parametrize("case", ["attnplug", "decode_only"])
def test_hook_admits_selected_attnplug_backends_with_a_plain_kv_pool(resolved, case):
    out, log = resolved
    assert "error" not in out[case], out[case]
    assert out[case]["hybrid_swa"] is False, out[case]
    assert "attnplug: GptOssForCausalLM's attention-backend check admits attnplug_triton" in log
    assert "attnplug: GptOssForCausalLM's attention-backend check admits attnplug_fa3" in log


def test_unselected_attnplug_changes_nothing(resolved):
    """SGLang's own backends resolve as without attnplug: triton keeps the hybrid SWA pool, torch_native
    (no sinks) is still refused by SGLang's check."""
    out, _ = resolved
    assert out["triton"]["hybrid_swa"] is True and out["triton"]["backends"][0] == "triton", out["triton"]
    assert out["torch_native"]["error"].startswith(REFUSAL), out["torch_native"]


def test_backend_refuses_a_hybrid_swa_pool_naming_the_flag():
    """A hybrid SWA pool reaching the backend (another hybrid-SWA model, which the hook leaves to SGLang)
    is refused at startup with the flag that gives attnplug a plain pool."""
    from sglang_helpers import make_runner
    from test_backend_unit import make_backend

    from attnplug.core import UnsupportedFeature

    runner = make_runner(1)
    runner.token_to_kv_pool = type("SWAKVPool", (), dict(vars(runner.token_to_kv_pool)))()
    with pytest.raises(
        UnsupportedFeature,
        match=r"attnplug: backend 'attnplug_triton' does not support the KV pool "
        r"SWAKVPool .*; start SGLang with --disable-hybrid-swa-memory",
    ):
        make_backend(runner, provider="reference")


def test_install_never_raises(monkeypatch, caplog):
    from sglang.srt.plugins import hook_registry

    from attnplug.sglang_adapter import model_gates

    def boom(*a, **k):
        raise RuntimeError("simulated SGLang API change")

    monkeypatch.setattr(model_gates, "_INSTALLED", set())
    monkeypatch.setattr(hook_registry.HookRegistry, "register", boom)
    assert model_gates.install() is False
    assert "attnplug: could not hook SGLang's per-model backend checks (RuntimeError: simulated" in caplog.text
