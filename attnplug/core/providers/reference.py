"""The ``reference`` provider: the float32 oracle, on any device (slow; for tests and demos).

It reads the plan's host twins per request, so it cannot be replayed from static buffers. fp8 KV:
attention of the float32 dequantized cache (``cache * scale``).
"""

from __future__ import annotations

import torch

from ..config import FP8_KV_DTYPES, SUPPORTED_DTYPES
from ..plan import Plan
from ..reference import reference_attention
from .base import GraphSupport, Provider, RaggedKernel


class ReferenceProvider(Provider):
    name = "reference"
    graph_support = GraphSupport(False, False, False, "the float32 reference loops over requests on the host")
    KV_DTYPES = frozenset(SUPPORTED_DTYPES + FP8_KV_DTYPES)
    NATIVE_SINKS = True
    IS_MLA = True  # the oracle computes MLA configs too (V: the first head_dim_v columns of the latent)
    RAGGED_IMPL = ".reference:ReferenceRagged"

    def plan(self, plan: Plan, static=None) -> None:
        pass

    def run(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        k_scale=None,
        v_scale=None,
        q_scale=None,
        host_scales=None,
        sinks=None,
    ) -> None:
        o, s = reference_attention(plan, q, k_cache, v_cache, k_scale, v_scale, sinks)
        out.copy_(o)
        if lse is not None:
            lse.copy_(s)


class ReferenceRagged(RaggedKernel):
    """The float32 oracle of the cache-free prefill (:func:`~attnplug.core.ragged.ragged_reference`)."""

    def run(self, plan, q, k, v, out) -> None:
        from ..ragged import ragged_reference  # noqa: PLC0415 - ragged imports the providers

        out.copy_(ragged_reference(plan, q, k, v, self.config.scale))


__all__ = ["ReferenceProvider", "ReferenceRagged"]
