"""``RaggedAttention``: attention over K/V given per token, no cache (FlashInfer's ragged prefill, FA3's
varlen call). SGLang runs an MLA model's prefill this way: the latent up-projected to per-head
``k [Tk, H, 192]`` and ``v [Tk, H, 128]`` (DeepSeek), request-major, each request's keys ending at its
last query (bottom-right causal).

    attn = RaggedAttention(RaggedConfig(16, 16, 192, 128, torch.bfloat16, scale), provider="fa3")
    attn.plan(qo_lens, kv_lens)   # once per forward, host lengths [B]
    out = attn.run(q, k, v)       # per layer: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> [Tq, Hq, Dv]

A provider serves it through its :attr:`~attnplug.core.providers.base.Provider.RAGGED_IMPL` class
(:class:`~attnplug.core.providers.base.RaggedKernel`); one without it is refused with attnplug's message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .config import SUPPORTED_DTYPES, UnsupportedFeature
from .providers import Provider, get_provider_cls


@dataclass(frozen=True)
class RaggedConfig:
    """Heads and head dims of a cache-free prefill: q ``[T, num_qo_heads, head_dim]``, k ``[T,
    num_kv_heads, head_dim]``, v / out ``[T, *, head_dim_v]``; ``sm_scale`` default ``head_dim ** -0.5``."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    sm_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "head_dim_v"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"attnplug: RaggedConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"attnplug: {self.num_qo_heads} query heads are not a multiple of {self.num_kv_heads}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedFeature(f"attnplug: ragged prefill in {self.dtype}")

    @property
    def scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_dim)


@dataclass
class RaggedPlan:
    """One forward's requests: ``cu_q`` / ``cu_k`` ``[B + 1]`` int32 on the device (and ``qo_indptr`` /
    ``kv_indptr`` on the host), the longest query / key run, ``causal`` (bottom-right aligned)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    max_q: int
    max_k: int
    causal: bool
    state: object = None  # the provider kernel's own (e.g. FlashInfer's planned wrapper)

    @property
    def num_q(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def num_k(self) -> int:
        return int(self.kv_indptr[-1])


class RaggedAttention:
    """Cache-free prefill through one provider.

    Raises:
        ProviderUnavailable: the provider cannot run here.
        UnsupportedFeature: it has no ragged prefill, or not for ``config`` (the message names attnplug,
            the provider and what it cannot run).
    """

    def __init__(self, config: RaggedConfig, provider: str | type[Provider] = "triton", device="cuda"):
        self.config = config
        self.device = torch.device(device)
        cls = get_provider_cls(provider) if isinstance(provider, str) else provider
        cls.check_available(self.device)
        refusal = ragged_refusal(cls, config)
        if refusal:
            raise UnsupportedFeature(f"attnplug: provider '{cls.name}' does not support {refusal}")
        self.provider_name = cls.name
        self.kernel = cls.ragged_class()(config, self.device)
        self._plan: RaggedPlan | None = None

    def plan(self, qo_lens, kv_lens, causal: bool = True) -> RaggedPlan:
        """Host lengths ``[B]`` (every ``kv_lens[b] >= qo_lens[b]`` where ``causal``): one copy to the device."""
        qo = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
        kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
        if qo.shape != kv.shape or qo.size == 0 or (qo < 0).any() or (kv < 0).any():
            raise ValueError(f"attnplug: ragged plan needs [B] non-negative lengths, got {qo_lens!r} / {kv_lens!r}")
        if causal and (kv < qo).any():
            raise ValueError("attnplug: a causal ragged plan needs kv_lens >= qo_lens (keys end at the last query)")
        indptr = np.zeros((2, qo.size + 1), dtype=np.int32)
        indptr[0, 1:], indptr[1, 1:] = np.cumsum(qo), np.cumsum(kv)
        cu = torch.from_numpy(indptr).to(self.device, non_blocking=True)
        plan = RaggedPlan(cu[0], cu[1], indptr[0], indptr[1], int(qo.max()), int(kv.max()), bool(causal))
        self.kernel.plan(plan)
        self._plan = plan
        return plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` (last dim contiguous) -> ``out [Tq, Hq, Dv]``."""
        plan, c = self._plan, self.config
        if plan is None:
            raise RuntimeError("attnplug: RaggedAttention.run() before plan()")
        want = {
            "q": (plan.num_q, c.num_qo_heads, c.head_dim),
            "k": (plan.num_k, c.num_kv_heads, c.head_dim),
            "v": (plan.num_k, c.num_kv_heads, c.head_dim_v),
        }
        for name, t in (("q", q), ("k", k), ("v", v)):
            if tuple(t.shape) != want[name] or t.dtype != c.dtype or t.stride(-1) != 1:
                raise ValueError(
                    f"attnplug: ragged {name} must be {list(want[name])} {c.dtype} with a contiguous last dim, "
                    f"got {list(t.shape)} {t.dtype} strides {t.stride()}"
                )
        if out is None:
            out = q.new_empty(plan.num_q, c.num_qo_heads, c.head_dim_v)
        self.kernel.run(plan, q, k, v, out)
        return out


def ragged_refusal(provider: type[Provider], config: RaggedConfig) -> str | None:
    """What of a cache-free prefill of ``config`` the provider cannot run (for the refusal); ``None``: it
    can. Asked without a device (engine adapters, at startup)."""
    impl = provider.ragged_class()
    if impl is None:
        return "ragged (cache-free) prefill"
    return impl.refusal(config)


def ragged_reference(plan: RaggedPlan, q, k, v, scale: float) -> torch.Tensor:
    """float32 reference of :meth:`RaggedAttention.run` (tests)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], hq, v.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(len(plan.qo_indptr) - 1):
        q0, q1 = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        k0, k1 = int(plan.kv_indptr[b]), int(plan.kv_indptr[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        kb = k[k0:k1].float().repeat_interleave(hq // hkv, 1)
        vb = v[k0:k1].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), kb) * scale
        if plan.causal:
            last = torch.arange(k1 - k0 - (q1 - q0), k1 - k0, device=q.device)[:, None]
            s = s.masked_fill(torch.arange(k1 - k0, device=q.device)[None, :] > last, -math.inf)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vb)
    return out


__all__ = ["RaggedAttention", "RaggedConfig", "RaggedPlan", "ragged_refusal", "ragged_reference"]
