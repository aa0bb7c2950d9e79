"""Messages name a real remedy: the fa3 install hint and ``register()`` without the engine installed."""

import importlib
import importlib.util
import logging

import pytest

from attnplug.core.providers import install_hint


def test_fa3_install_hint_names_what_really_provides_fa3():
    hint = install_hint("fa3")
    assert "flash-attn-3" not in hint  # no such package on PyPI
    for source in ("pip install vllm", "pip install sglang-kernel", "flash-attention/hopper", "flash_attn_interface"):
        assert source in hint, (source, hint)


def test_install_hints_name_packages_pip_can_find():
    """attnplug is on no package index: a hint names the library's own package, not attnplug[extra]."""
    assert "pip install 'triton>=3.6'" in install_hint("triton")
    assert "pip install flashinfer-python" in install_hint("flashinfer")
    for name in ("triton", "flashinfer", "fa3"):
        hint = install_hint(name)
        assert "pip install 'attnplug[" not in hint and "pip install attnplug" not in hint, hint


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize(
    "module, engine, adapter",
    [("vllm", "vLLM", "attnplug.vllm_adapter"), ("sglang", "SGLang", "attnplug.sglang_adapter")],
)
def test_register_without_the_engine_logs_one_fact(monkeypatch, module, engine, adapter):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    mod = importlib.import_module(adapter)
    handler = _Records()
    mod.logger.addHandler(handler)
    old_level = mod.logger.level
    mod.logger.setLevel(logging.DEBUG)
    try:
        mod.register()
    finally:
        mod.logger.removeHandler(handler)
        mod.logger.setLevel(old_level)
    assert len(handler.records) == 1, [r.getMessage() for r in handler.records]
    rec = handler.records[0]
    msg = rec.getMessage()
    assert f"attnplug: {engine} is not installed" in msg and rec.exc_info is None, msg
    assert "outside the tested range" not in msg


def test_engine_missing_is_silent_when_the_module_is_there():
    from attnplug.engine_glue import engine_missing

    log = logging.getLogger("attnplug.test_messages")
    handler = _Records()
    log.addHandler(handler)
    try:
        assert engine_missing("json", "JSON", log) is False
        assert engine_missing("attnplug_no_such_engine", "Nothing", log) is True
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in handler.records] == [
        "attnplug: Nothing is not installed in this environment (no module 'attnplug_no_such_engine'): "
        "the attnplug Nothing backends are not registered"
    ]
