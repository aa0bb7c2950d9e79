"""Provider registry: backend name -> provider class and install hint, the one table of both.

Providers are imported lazily: a missing library never breaks ``import attnplug``, and importing a
provider module never imports its kernel library (that happens in ``check_available`` / at first use).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .base import NO_GRAPHS, GraphSupport, Provider, ProviderGraph, ProviderUnavailable


@dataclass(frozen=True)
class ProviderEntry:
    """``target``: ``"module:Class"`` (a module relative to this package, or absolute);
    ``install_hint``: how to make the provider available, for error messages."""

    target: str
    install_hint: str


_REGISTRY: dict[str, ProviderEntry] = {
    "reference": ProviderEntry(".reference:ReferenceProvider", "nothing to install (PyTorch only)"),
    "triton": ProviderEntry(
        ".triton:TritonProvider",
        "pip install 'attnplug[triton]' (triton >= 3.6 on a GPU; on a CPU-only machine triton >= 3.7 runs the "
        "kernels through its interpreter, TRITON_INTERPRET=1, which the engine adapters switch on themselves)",
    ),
    "flashinfer": ProviderEntry(
        ".flashinfer:FlashInferProvider",
        "a CUDA GPU and FlashInfer: pip install 'attnplug[flashinfer]' (flashinfer-python; see "
        "https://docs.flashinfer.ai/installation.html)",
    ),
    "fa3": ProviderEntry(
        ".fa3:FA3Provider",
        "a Hopper (sm90) GPU and a FlashAttention-3 build, any of: pip install flash-attn-3 (the hopper build "
        "of https://github.com/Dao-AILab/flash-attention), pip install sgl-kernel, or vllm (its "
        "vllm_flash_attn with _vllm_fa3_C)",
    ),
}


def provider_names() -> tuple[str, ...]:
    """Registered provider names, in registration order."""
    return tuple(_REGISTRY)


PROVIDER_NAMES = provider_names()  # the built-in ones


def register_provider(name: str, target: str, install_hint: str) -> None:
    """Add (or replace) a provider: ``target`` is ``"package.module:Class"``."""
    _REGISTRY[name] = ProviderEntry(target, install_hint)


def install_hint(name: str) -> str:
    """How to make provider ``name`` available."""
    entry = _REGISTRY.get(name)
    return entry.install_hint if entry else f"unknown provider {name!r}; expected one of {provider_names()}"


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
        module = importlib.import_module(mod, __name__ if mod.startswith(".") else None)
    except ModuleNotFoundError as e:  # the provider module itself is missing from this build
        raise ProviderUnavailable(f"attnplug: provider {name!r} is not available: {e}. "
                                  f"To install: {entry.install_hint}") from e  # fmt: skip
    return getattr(module, cls)


def available_providers(device) -> list[str]:
    """Names of the providers that can run on ``device`` here."""
    names = []
    for name in provider_names():
        try:
            get_provider_cls(name).check_available(device)
        except ProviderUnavailable:
            continue
        names.append(name)
    return names


__all__ = [
    "GraphSupport",
    "NO_GRAPHS",
    "PROVIDER_NAMES",
    "Provider",
    "ProviderGraph",
    "ProviderUnavailable",
    "available_providers",
    "get_provider_cls",
    "install_hint",
    "provider_names",
    "register_provider",
]
