"""Plugin registration: entry point, registry + CLI choices, never raises, imports nothing heavy."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from sglang_helpers import subprocess_env

import attnplug.sglang_adapter as adapter
from attnplug.sglang_adapter import compat

pytestmark = pytest.mark.sglang

NAMES = ["attnplug_triton", "attnplug_flashinfer", "attnplug_fa3"]


def test_entry_point_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("attnplug") == "attnplug.sglang_adapter:register"


def test_register_adds_backends_and_choices_idempotently():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    adapter.register()
    adapter.register()
    choices = compat.attention_backend_choices()
    for name in NAMES:
        assert name in ATTENTION_BACKENDS
        assert choices.count(name) == 1
    # the list argparse uses: 0.5.23 keeps it in arg_groups.choices (server_args re-exports it),
    # 0.5.17 in server_args
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES as in_server_args

    assert choices is in_server_args
    try:
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    except ImportError:
        assert compat.sglang_version().startswith("0.5.17")
    else:
        assert choices is ATTENTION_BACKEND_CHOICES


def test_register_never_raises(monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("simulated SGLang API change")

    monkeypatch.setattr(compat, "register_attention_backend", boom)
    adapter.register()  # must not raise
    assert "attnplug: SGLang plugin registration failed (RuntimeError: simulated SGLang API change)" in caplog.text


_CLI_CHECK = r"""
import sys
from sglang.srt.server_args import prepare_server_args
argv = ["--model-path", sys.argv[1], "--device", "cpu", "--attention-backend", "attnplug_triton"]
try:
    prepare_server_args(argv)
    print("BEFORE: accepted")
except SystemExit:
    print("BEFORE: rejected")
HEAVY = ("attnplug.core.providers", "attnplug.core.attention", "attnplug.sglang_adapter.backend",
         "attnplug.core.providers.triton")
heavy = [m for m in HEAVY if m in sys.modules]
from sglang.srt.plugins import load_plugins
load_plugins()
heavy += [m for m in HEAVY if m in sys.modules]
print("HEAVY:", heavy)
print("AFTER:", prepare_server_args(argv).attention_backend)
"""


def test_cli_accepts_backend_only_through_the_plugin(tiny_model):
    """Without the plugin the CLI rejects the name; load_plugins() (what launch_server runs) adds it,
    importing neither the backend nor the core."""
    r = subprocess.run(
        [sys.executable, "-c", _CLI_CHECK, str(tiny_model)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "BEFORE: rejected" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "HEAVY: []" in r.stdout, r.stdout
    assert "AFTER: attnplug_triton" in r.stdout, r.stdout + r.stderr[-3000:]


def test_prepare_hook_only_acts_when_attnplug_triton_runs_on_cpu(monkeypatch):
    from types import SimpleNamespace

    hook = adapter._prepare_selected_providers
    for backend, device in [("torch_native", "cpu"), ("triton", "cpu"), ("attnplug_triton", "cuda")]:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert hook("result", SimpleNamespace(attention_backend=backend, device=device)) is None
        assert "TRITON_INTERPRET" not in os.environ, (backend, device)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the user's explicit choice wins
    hook(None, SimpleNamespace(attention_backend="attnplug_triton", device="cpu"))
    assert os.environ["TRITON_INTERPRET"] == "0"
    monkeypatch.delenv("TRITON_INTERPRET")
    hook(None, SimpleNamespace(attention_backend=None, decode_attention_backend="attnplug_triton", device="cpu"))
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_register_hooks_server_args_resolution():
    from sglang.srt.plugins.hook_registry import HookRegistry

    adapter.register()
    target = compat.server_args_resolution_target()
    assert target.endswith(".resolve_once" if compat.sglang_version() == "0.5.23" else ".__post_init__")
    hooks = HookRegistry._hooks[target]
    assert [h for _, h, _ in hooks].count(adapter._prepare_selected_providers) == 1


def test_attnplug_kernels_hash_after_sglang_patches_triton():
    """SGLang replaces ``triton.next_power_of_2`` with a plain function at import; every attnplug kernel
    must still pass Triton's dependency hash (the step before each compile; on a GPU it failed inside
    SGLang's decode graph capture). Real JIT functions, no interpreter, no GPU."""
    check = os.path.join(os.path.dirname(__file__), os.pardir, "kernel_hash_check.py")
    r = subprocess.run(
        [sys.executable, check, "import:sglang.srt.utils.common"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "triton.next_power_of_2 from sglang" in r.stdout, r.stdout  # the patch under test is in place
    assert int(r.stdout.split("seen", 1)[1].split()[0]) >= 10, r.stdout
