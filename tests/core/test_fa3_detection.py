"""Which FA3 build the fa3 provider picks (CPU: fake modules stand in for the builds)."""

import sys
import types

import pytest

from attnplug.core.providers import fa3
from attnplug.core.providers.base import ProviderUnavailable

BUILDS = ["flash_attn_interface", "sgl_kernel.flash_attn", "vllm.vllm_flash_attn", "vllm_flash_attn"]


def _fake(monkeypatch, present: dict[str, types.ModuleType]) -> None:
    """Make exactly ``present`` importable; every other build's import fails."""
    monkeypatch.setattr(fa3, "_LIB", None)
    for name in [
        "flash_attn_interface",
        "sgl_kernel",
        "sgl_kernel.flash_attn",
        "vllm",
        "vllm.vllm_flash_attn",
        "vllm.vllm_flash_attn.flash_attn_interface",
        "vllm_flash_attn",
        "vllm_flash_attn.flash_attn_interface",
    ]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules -> ImportError
    for name, mod in present.items():
        monkeypatch.setitem(sys.modules, name, mod)


def _vllm_style(available: bool) -> types.ModuleType:
    m = types.ModuleType("flash_attn_interface")
    m.FA3_AVAILABLE = available
    m.FA3_UNAVAILABLE_REASON = None if available else "no _vllm_fa3_C"
    m.flash_attn_varlen_func = lambda *a, **k: None
    return m


def test_standalone_vllm_flash_attn_is_found_last(monkeypatch):
    iface = _vllm_style(True)
    pkg = types.ModuleType("vllm_flash_attn")
    pkg.flash_attn_interface = iface
    _fake(monkeypatch, {"vllm_flash_attn": pkg, "vllm_flash_attn.flash_attn_interface": iface})
    lib = fa3.load_fa3()
    assert lib.source.startswith("vllm_flash_attn (standalone")
    assert lib.fn is iface.flash_attn_varlen_func


def test_hopper_build_wins_over_the_others(monkeypatch):
    hopper = types.ModuleType("flash_attn_interface")
    hopper.flash_attn_with_kvcache = lambda *a, **k: None
    iface = _vllm_style(True)
    pkg = types.ModuleType("vllm_flash_attn")
    pkg.flash_attn_interface = iface
    _fake(
        monkeypatch,
        {"flash_attn_interface": hopper, "vllm_flash_attn": pkg, "vllm_flash_attn.flash_attn_interface": iface},
    )
    assert fa3.load_fa3().source == "flash_attn_interface"


def test_none_importable_lists_every_attempt(monkeypatch):
    iface = _vllm_style(False)  # the library is there but its FA3 extension is not
    pkg = types.ModuleType("vllm_flash_attn")
    pkg.flash_attn_interface = iface
    _fake(monkeypatch, {"vllm_flash_attn": pkg, "vllm_flash_attn.flash_attn_interface": iface})
    with pytest.raises(ProviderUnavailable) as e:
        fa3.load_fa3()
    for b in [
        "flash_attn_interface",
        "sgl_kernel.flash_attn",
        "vllm.vllm_flash_attn",
        "vllm_flash_attn",
        "no _vllm_fa3_C",
    ]:
        assert b in str(e.value)
