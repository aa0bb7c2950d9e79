"""The ``reference`` provider: the float32 oracle, on any device (slow; for tests and demos)."""

from __future__ import annotations

import torch

from ..plan import Plan
from ..reference import reference_attention
from .base import Provider


class ReferenceProvider(Provider):
    name = "reference"

    def plan(self, plan: Plan) -> None:
        pass

    def run(self, plan: Plan, q, k_cache, v_cache, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        o, s = reference_attention(plan, q, k_cache, v_cache)
        out.copy_(o)
        if lse is not None:
            lse.copy_(s)
