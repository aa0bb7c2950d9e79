"""Provider registry: backend name -> provider class and install hint, the one table of both engines.

Light on purpose (no torch, no provider module): the engine adapters read it while registering, before
anything is selected. Providers are imported lazily by :func:`get_provider_cls`: a missing library never
breaks ``import attnplug``, and importing a provider module never imports its kernel library (that
happens in ``check_available`` / at first use).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .providers.base import Provider


@dataclass(frozen=True)
class ProviderEntry:
    """``target``: ``"module:Class"`` (a module relative to this package, or absolute);
    ``install_hint``: how to make the provider available, for error messages; ``title``: the name as
    engine class names spell it (default: capitalized); ``served``: the engines offer it as a backend
    (``False``: the float32 oracle, reachable through ``ATTNPLUG_PROVIDER_OVERRIDE`` only)."""

    target: str
    install_hint: str
    title: str = ""
    served: bool = True


_REGISTRY: dict[str, ProviderEntry] = {
    "reference": ProviderEntry(".reference:ReferenceProvider", "nothing to install (PyTorch only)", served=False),
    "triton": ProviderEntry(
        ".triton:TritonProvider",
        "pip install 'triton>=3.6' (attnplug's [triton] extra; on a CPU-only machine triton >= 3.7 runs the "
        "kernels through its interpreter, TRITON_INTERPRET=1, which the engine adapters switch on themselves)",
    ),
    "flashinfer": ProviderEntry(
        ".flashinfer:FlashInferProvider",
        "a CUDA GPU and FlashInfer: pip install flashinfer-python (attnplug's [flashinfer] extra; see "
        "https://docs.flashinfer.ai/installation.html)",
        title="FlashInfer",
    ),
    "fa3": ProviderEntry(
        ".fa3:FA3Provider",
        "a Hopper (sm90) GPU and a FlashAttention-3 build; no PyPI package carries FA3 alone. Any of: vLLM's "
        "CUDA wheel (pip install vllm: its vllm_flash_attn holds FA3), SGLang's kernel wheel (pip install "
        "sglang-kernel: module sgl_kernel), or FlashAttention's hopper build from source (git clone "
        "https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && python setup.py install: "
        "module flash_attn_interface)",
        title="FA3",
    ),
}


def provider_names() -> tuple[str, ...]:
    """Registered provider names, in registration order."""
    return tuple(_REGISTRY)


PROVIDER_NAMES = provider_names()  # the built-in ones


def register_provider(name: str, target: str, install_hint: str, title: str = "", served: bool = True) -> None:
    """Add (or replace) a provider: ``target`` is ``"package.module:Class"``; both engine adapters then
    offer it as a backend (``served``) named from ``name`` (and ``title``, see :class:`ProviderEntry`)."""
    _REGISTRY[name] = ProviderEntry(target, install_hint, title, served)


def served_providers() -> dict[str, str]:
    """The providers the engines offer as backends, in registration order: name -> title
    (``"flashinfer"`` -> ``"FlashInfer"``)."""
    return {n: e.title or n.capitalize() for n, e in _REGISTRY.items() if e.served}


def install_hint(name: str) -> str:
    """How to make provider ``name`` available."""
    entry = _REGISTRY.get(name)
    return entry.install_hint if entry else f"unknown provider {name!r}; expected one of {provider_names()}"


#: Debug only: run every attnplug backend on this core provider (e.g. ``reference``, the float32 oracle).
PROVIDER_OVERRIDE_ENV = "ATTNPLUG_PROVIDER_OVERRIDE"


def selected_provider(default: str) -> str:
    """The provider name a backend whose own provider is ``default`` runs (``$ATTNPLUG_PROVIDER_OVERRIDE`` wins)."""
    return os.environ.get(PROVIDER_OVERRIDE_ENV) or default


def resolve_provider(default: str, chosen: str | None = None) -> tuple[str, type[Provider]]:
    """``(name, class)`` of the provider an engine backend runs, resolved once by the backend and passed
    down as a class: ``chosen`` if given, else :func:`selected_provider` of the backend's ``default``.

    Raises:
        ValueError: unknown name.
        ProviderUnavailable: the provider's module cannot be imported here.
    """
    name = chosen or selected_provider(default)
    return name, get_provider_cls(name)


def get_provider_cls(name: str) -> type[Provider]:
    """Return the provider class for ``name``.

    Raises:
        ValueError: unknown name.
        ProviderUnavailable: the provider's module cannot be imported here.
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"attnplug: unknown provider {name!r}; expected one of {provider_names()}")
    mod, cls = entry.target.split(":")
    try:
        module = importlib.import_module(mod, "attnplug.core.providers" if mod.startswith(".") else None)
    except ModuleNotFoundError as e:  # the provider module itself is missing from this build
        from .providers.base import ProviderUnavailable  # noqa: PLC0415 - torch only when a provider is asked for

        raise ProviderUnavailable(
            f"attnplug: provider {name!r} is not available: {e}. To install: {entry.install_hint}"
        ) from e
    return getattr(module, cls)
