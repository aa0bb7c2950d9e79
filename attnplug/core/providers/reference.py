"""The ``reference`` provider: the float32 oracle, on any device (slow; for tests and demos).

It reads the plan's host twins per request, so it cannot be replayed from static buffers.
"""

from __future__ import annotations

import torch

from ..plan import Plan
from ..reference import reference_attention
from .base import GraphSupport, Provider


class ReferenceProvider(Provider):
    name = "reference"
    graph_support = GraphSupport(False, False, False, "the float32 reference loops over requests on the host")

    def plan(self, plan: Plan, static=None) -> None:
        pass

    def run(self, plan: Plan, q, k_cache, v_cache, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        o, s = reference_attention(plan, q, k_cache, v_cache)
        out.copy_(o)
        if lse is not None:
            lse.copy_(s)


__all__ = ["ReferenceProvider"]
