"""The SGLang adapter's backends come from the core's registry: a provider added as one file plus one
registry line (``tests/toy_provider.py``) is an SGLang backend and a CLI choice, with no adapter edit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import attnplug.sglang_adapter as adapter
from attnplug.sglang_adapter import compat

pytestmark = pytest.mark.sglang


@pytest.fixture
def toy(monkeypatch):
    """The toy provider registered; SGLang's registry, choice lists and hooks restored afterwards (the
    other tests read them)."""
    from collections import defaultdict

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import toy_provider

    lists = [x for x in (compat.attention_backend_choices(), compat.draft_attention_backend_choices()) if x is not None]
    saved, backends = [list(x) for x in lists], dict(ATTENTION_BACKENDS)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(compat, "_HOOKED", set())
    toy_provider.register()
    yield toy_provider
    toy_provider.register(served=False)
    for x, s in zip(lists, saved):
        x[:] = s
    ATTENTION_BACKENDS.clear()
    ATTENTION_BACKENDS.update(backends)


def test_builtin_backends_are_the_served_providers():
    assert {n: v for n, v in adapter.BACKENDS.items() if n != "attnplug_toy"} == {
        "attnplug_triton": "triton",
        "attnplug_flashinfer": "flashinfer",
        "attnplug_fa3": "fa3",
    }


def test_a_registered_provider_is_an_sglang_backend(toy):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert adapter.BACKENDS["attnplug_toy"] == toy.TOY
    adapter.register()
    assert "attnplug_toy" in ATTENTION_BACKENDS
    assert compat.attention_backend_choices().count("attnplug_toy") == 1
