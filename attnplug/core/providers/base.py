"""Provider contract: ``plan`` once per forward (host work allowed), ``run`` per layer (none)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..config import AttentionConfig, UnsupportedFeature
from ..plan import Plan


class ProviderUnavailable(RuntimeError):
    """The provider cannot run on this machine (missing GPU or library); the message says how to fix it."""


class Provider(ABC):
    """One kernel library behind the core's plan/run contract.

    Subclasses set ``name`` and implement ``check_config``, ``plan`` and ``run``.
    """

    name: str = "?"

    def __init__(self, config: AttentionConfig, device: torch.device):
        self.config = config
        self.device = device
        self.check_available(device)
        self.check_config(config)

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        """Raise :class:`ProviderUnavailable` when this provider cannot run on ``device``."""

    def check_config(self, config: AttentionConfig) -> None:
        """Raise :class:`UnsupportedFeature` for configurations this provider cannot compute."""

    def unsupported(self, feature: str) -> UnsupportedFeature:
        return UnsupportedFeature(f"attnplug: provider '{self.name}' does not support {feature}")

    @abstractmethod
    def plan(self, plan: Plan) -> None:
        """Add this provider's kernel arguments to ``plan.extra`` (host work allowed here)."""

    @abstractmethod
    def run(
        self,
        plan: Plan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Write attention of ``q [T, Hq, D]`` over the paged cache into ``out [T, Hq, D]``
        (and the natural-log LSE into ``lse [T, Hq]`` float32 when given). No host work."""
