"""The vLLM adapter's backends come from the core's registry: a provider added as one file plus one
registry line (``tests/toy_provider.py``) is a vLLM backend, with no adapter edit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from attnplug import vllm_adapter
from attnplug.core.providers import served_providers
from attnplug.vllm_adapter import compat


@pytest.fixture
def toy():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import toy_provider

    toy_provider.register()
    yield toy_provider
    toy_provider.register(served=False)


def test_builtin_backends_are_the_served_providers():
    assert {n: v for n, v in vllm_adapter.BACKENDS.items() if n != "ATTNPLUG_TOY"} == {  # the toy: other tests
        "ATTNPLUG_TRITON": ("triton", "attnplug.vllm_adapter.backend.AttnplugTritonBackend"),
        "ATTNPLUG_FLASHINFER": ("flashinfer", "attnplug.vllm_adapter.backend.AttnplugFlashInferBackend"),
        "ATTNPLUG_FA3": ("fa3", "attnplug.vllm_adapter.backend.AttnplugFA3Backend"),
    }
    assert "reference" not in served_providers()  # the oracle is no engine backend


def test_a_registered_provider_is_a_vllm_backend(toy):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert vllm_adapter.BACKENDS["ATTNPLUG_TOY"] == ("toy", "attnplug.vllm_adapter.backend.AttnplugToyBackend")
    vllm_adapter.register()
    member = compat._enum()["ATTNPLUG_TOY"]  # vLLM's own backend enum now lists it
    backend = resolve_obj_by_qualname(member.value)
    assert backend.get_name() == "ATTNPLUG_TOY" and backend.PROVIDER == toy.TOY
    assert backend.get_impl_cls().BACKEND is backend and backend.get_builder_cls().BACKEND is backend
