"""The provider contract (:mod:`.base`), the registry's names (:mod:`attnplug.core.registry`) and the one
provider instance of each layer config (:func:`provider_instance`)."""

from __future__ import annotations

import weakref

import torch

from ..registry import (
    PROVIDER_NAMES,
    get_provider_cls,
    install_hint,
    provider_names,
    register_provider,
    served_providers,
)
from .base import NO_GRAPHS, GraphSupport, Provider, ProviderGraph, ProviderUnavailable

_INSTANCES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def provider_instance(provider: str | type[Provider] | Provider, config, device) -> Provider:
    """The one instance of ``provider`` (a registered name, a provider class, or an instance, returned
    as it is) for ``config`` on ``device``: every core object of one layer config shares it and its
    resources (e.g. FlashInfer's workspace), forking it where its plans must stay apart
    (:meth:`Provider.fork`). Kept while something uses it.

    Raises:
        ValueError: unknown name, or an instance built for another config.
        ProviderUnavailable, UnsupportedFeature: as the provider's constructor.
    """
    device = torch.device(device)
    if isinstance(provider, Provider):
        if provider.config != config:
            raise ValueError(f"attnplug: provider '{provider.name}' was built for {provider.config}, not {config}")
        return provider
    cls = get_provider_cls(provider) if isinstance(provider, str) else provider
    key = (cls, config, device)
    inst = _INSTANCES.get(key)
    if inst is None:
        inst = _INSTANCES[key] = cls(config, device)
    else:
        cls.check_available(device)  # checked at every use, as a new instance would be
    return inst


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
    "provider_instance",
    "provider_names",
    "register_provider",
    "served_providers",
]
