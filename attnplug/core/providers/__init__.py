"""Provider registry. Providers are imported lazily: a missing library never breaks ``import attnplug``."""

from __future__ import annotations

import importlib

from .base import Provider, ProviderUnavailable

# name -> "module:Class", relative to this package
_REGISTRY: dict[str, str] = {
    "reference": ".reference:ReferenceProvider",
    "triton": ".triton:TritonProvider",
    "flashinfer": ".flashinfer:FlashInferProvider",
    "fa3": ".fa3:FA3Provider",
}

PROVIDER_NAMES = tuple(_REGISTRY)


def get_provider_cls(name: str) -> type[Provider]:
    """Return the provider class for ``name``.

    Raises:
        ValueError: unknown name.
        ProviderUnavailable: the provider's module cannot be imported here.
    """
    if name not in _REGISTRY:
        raise ValueError(f"attnplug: unknown provider {name!r}; expected one of {PROVIDER_NAMES}")
    mod, cls = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(mod, __name__)
    except ModuleNotFoundError as e:  # the provider module itself is missing from this build
        raise ProviderUnavailable(f"attnplug: provider {name!r} is not available: {e}") from e
    return getattr(module, cls)


def available_providers(device) -> list[str]:
    """Names of the providers that can run on ``device`` here."""
    names = []
    for name in PROVIDER_NAMES:
        try:
            get_provider_cls(name).check_available(device)
        except ProviderUnavailable:
            continue
        names.append(name)
    return names


__all__ = ["Provider", "ProviderUnavailable", "PROVIDER_NAMES", "get_provider_cls", "available_providers"]
