"""Engine-agnostic attention core: config, batch metadata, plan/run, paged KV, radix tree, providers.

Imports neither vLLM nor SGLang.
"""

from .attention import PagedAttention
from .config import AttentionConfig, UnsupportedFeature
from .metadata import BatchMetadata, ForwardMode
from .plan import Plan, make_plan
from .providers import PROVIDER_NAMES, ProviderUnavailable, available_providers
from .reference import reference_attention

__all__ = [
    "AttentionConfig",
    "BatchMetadata",
    "ForwardMode",
    "PagedAttention",
    "Plan",
    "PROVIDER_NAMES",
    "ProviderUnavailable",
    "UnsupportedFeature",
    "available_providers",
    "make_plan",
    "reference_attention",
]
