"""Engine-agnostic attention core: config, batch metadata, plan/run, paged KV, radix tree, providers.

Imports neither vLLM nor SGLang; the names below load on first use, so that importing
:mod:`attnplug.core.registry` (what the engine adapters read while registering) stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PagedAttention": ".attention",
    "RaggedAttention": ".ragged",
    "RaggedConfig": ".ragged",
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
    # what the engine adapters use: one entry point
    "resolve_provider": ".registry",
    "GraphFamily": ".graph_family",
    "FILL_SEQ_LEN": ".cuda_graph",
    "write_kv_capturable": ".kv_layout",
    "cascade_mode": ".cascade",
    "graph_cascade_mode": ".cascade",
    "num_pages": ".pages",
    "csr_from_req_to_token": ".page_table",
    "FP8_KV_DTYPES": ".config",
    "KV_DTYPE_NAMES": ".config",
    "MAX_PAGE_SIZE": ".config",
    "is_fp8": ".config",
    "kv_dtype_from_name": ".config",
    "MultiStepDraftPlanner": ".draft",
    "step_batches_from_token_table": ".draft",
    "token_config": ".draft",
    "token_view": ".draft",
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
