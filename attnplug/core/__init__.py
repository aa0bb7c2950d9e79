"""Engine-agnostic attention core: config, batch metadata, plan/run, paged KV, radix tree, providers.

Imports neither vLLM nor SGLang; the names below load on first use, so that importing
:mod:`attnplug.core.registry` (what the engine adapters read while registering) stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PagedAttention": ".attention",
    "AttentionConfig": ".config",
    "UnsupportedFeature": ".config",
    "BatchMetadata": ".metadata",
    "ForwardMode": ".metadata",
    "Plan": ".plan",
    "make_plan": ".plan",
    "PROVIDER_NAMES": ".registry",
    "ProviderUnavailable": ".providers",
    "available_providers": ".providers",
    "provider_instance": ".providers",
    "reference_attention": ".reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
