"""Static attention configuration: what stays fixed for all layers that share one plan."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Quantized KV-cache dtypes (per-layer scale, ``value = stored * scale``).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Engine names of KV-cache dtypes (vLLM ``--kv-cache-dtype``, SGLang ``--kv-cache-dtype``); ``"fp8"``
#: is e4m3 (vLLM on CUDA and CPU). ``"auto"`` / ``None``: the model dtype.
KV_DTYPE_NAMES = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def env_flag(name: str, default: bool) -> bool:
    """An on/off switch read from ``$name``: ``1`` / ``on`` or ``0`` / ``off`` (unset or empty: ``default``);
    any other value raises ``ValueError`` naming attnplug and the variable."""
    v = os.environ.get(name, "").strip().lower()
    if v not in ("", "0", "1", "off", "on"):
        raise ValueError(f"attnplug: {name} must be 0 or 1, got {v!r}")
    return default if v == "" else v in ("1", "on")


def kv_dtype_from_name(name: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV-cache dtype an engine's ``kv_cache_dtype`` setting names (``"auto"`` / ``None``: the
    model dtype; a torch dtype passes through). ``ValueError`` for a name attnplug does not know."""
    if name is None or name == "auto":
        return model_dtype
    if isinstance(name, torch.dtype):
        return name
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"attnplug: unknown KV-cache dtype {name!r}; known: auto, {', '.join(KV_DTYPE_NAMES)}")
    return KV_DTYPE_NAMES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """``dtype`` is a quantized (fp8) KV dtype."""
    return dtype in FP8_KV_DTYPES


SUPPORTED_LAYOUTS = ("NHD", "HND")
MAX_PAGE_SIZE = 256


class UnsupportedFeature(ValueError):
    """A configuration attnplug (or one provider) does not support; the message names both."""


@dataclass(frozen=True)
class AttentionConfig:
    """Shape and numerics of one attention layer family.

    Attributes:
        num_qo_heads: query/output heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv``; ``Hq % Hkv == 0`` (GQA ratio ``Hq // Hkv``).
        head_dim: ``D``, for q, k and v.
        page_size: tokens per KV page ``P`` (1..256).
        dtype: dtype of q, k_cache, v_cache and the output.
        kv_layout: ``"NHD"`` -> cache ``[num_pages, P, Hkv, D]``; ``"HND"`` -> ``[num_pages, Hkv, P, D]``.
        sm_scale: softmax scale; ``None`` means ``1/sqrt(D)``.
        logits_soft_cap: ``> 0`` applies ``cap * tanh(s / cap)`` to the scaled logits; 0 disables.
        window_left: sliding window: query at position ``p`` sees keys ``p - window_left .. p``;
            ``-1`` disables.
        kv_dtype: dtype of k_cache / v_cache: ``None`` (default) = ``dtype``; else ``dtype`` itself or
            an fp8 dtype (``torch.float8_e4m3fn``, ``torch.float8_e5m2``): the cache then holds
            ``value / scale`` quantized with saturation (per-layer ``k_scale`` / ``v_scale`` tensors,
            passed to ``PagedAttention.run``) and every provider dequantizes on read.
        sinks: the layers have attention sinks: one learned logit per query head (a ``[Hq]`` tensor
            passed to every run entry point as ``sinks=``) that joins each row's softmax denominator
            once, with no value row: ``softmax([s_1..s_n, sink_h])``; the LSE a run writes includes it.
        head_dim_v: value/output head dim; ``None`` (default) = ``head_dim``. A smaller one is MLA
            (multi-head latent attention, :mod:`attnplug.core.mla`): one KV head holding the latent
            ``[kv_lora_rank + rope_dim]`` per token, V = its first ``head_dim_v`` columns, q ``[T, Hq,
            head_dim]`` absorbed, out ``[T, Hq, head_dim_v]``.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16
    kv_layout: str = "NHD"
    sm_scale: float | None = None
    logits_soft_cap: float = 0.0
    window_left: int = -1
    kv_dtype: torch.dtype | None = None
    sinks: bool = False
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "window_left"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {v!r}")
            # normalized to a Python int: a numpy integer would turn the plans' int32 metadata into int64
            object.__setattr__(self, name, int(v))
        if self.num_qo_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError(
                f"num_qo_heads and num_kv_heads must be positive, got {self.num_qo_heads}, {self.num_kv_heads}"
            )
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {self.page_size}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")
        if self.kv_layout not in SUPPORTED_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {SUPPORTED_LAYOUTS}, got {self.kv_layout!r}")
        if self.logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0, got {self.logits_soft_cap}")
        if self.window_left < -1:
            raise ValueError(f"window_left must be -1 (off) or >= 0, got {self.window_left}")
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)  # normalized: equal configs compare equal
        elif self.kv_dtype != self.dtype and not is_fp8(self.kv_dtype):
            raise ValueError(
                f"kv_dtype must be None, the model dtype {self.dtype} or one of {FP8_KV_DTYPES}, got {self.kv_dtype}"
            )
        if not isinstance(self.sinks, bool):
            raise ValueError(f"sinks must be a bool, got {self.sinks!r}")
        self._check_head_dim_v()

    def _check_head_dim_v(self) -> None:
        """Normalize ``head_dim_v`` (``None`` -> ``head_dim``) and check an MLA config (one KV head,
        NHD, ``0 < head_dim_v < head_dim``; soft cap, window and sinks refused)."""
        v = self.head_dim if self.head_dim_v is None else self.head_dim_v
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"head_dim_v must be None or an int, got {v!r}")
        object.__setattr__(self, "head_dim_v", int(v))
        if self.head_dim_v == self.head_dim:
            return
        if not 0 < self.head_dim_v < self.head_dim:
            raise ValueError(
                f"head_dim_v must be in 1..head_dim={self.head_dim} (MLA: kv_lora_rank < "
                f"kv_lora_rank + rope dim), got {self.head_dim_v}"
            )
        if self.num_kv_heads != 1 or self.kv_layout != "NHD":
            raise ValueError(
                f"attnplug: MLA (head_dim_v != head_dim) needs num_kv_heads=1 and "
                f"kv_layout='NHD' (one latent KV head), got {self.num_kv_heads}, "
                f"{self.kv_layout!r}"
            )
        for feature, on in (
            ("a logits soft cap", self.logits_soft_cap > 0),
            ("a sliding window", self.window_left >= 0),
            ("attention sinks", self.sinks),
        ):
            if on:
                raise UnsupportedFeature(f"attnplug: MLA (multi-head latent attention) does not support {feature}")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: V is the first :attr:`head_dim_v` columns of the one K head."""
        return self.head_dim_v != self.head_dim

    @property
    def kv_lora_rank(self) -> int:
        """MLA: the latent width ``R`` (= :attr:`head_dim_v`)."""
        return self.head_dim_v

    @property
    def rope_dim(self) -> int:
        """MLA: the rotary part ``Dr`` of each latent row (``head_dim - head_dim_v``; 0 otherwise)."""
        return self.head_dim - self.head_dim_v

    @property
    def kv_quantized(self) -> bool:
        """The KV cache is fp8: stored values times the layer's k/v scale are the keys/values."""
        return is_fp8(self.kv_dtype)

    @property
    def group_size(self) -> int:
        """GQA ratio ``Hq // Hkv``."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        """Softmax scale actually used."""
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def scale_kwargs(
        self,
        unit: torch.Tensor | None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        host_scales: tuple[float, float] | None = None,
    ) -> dict:
        """The scale keyword arguments of ``Provider.run``: ``{}`` for an unquantized cache (the
        scales mean nothing there), else ``k_scale`` / ``v_scale`` / ``q_scale`` with ``unit`` (a
        one-element float32 ones tensor on the device) for each one not given, and ``host_scales``
        (``(k, v)`` floats) when given."""
        if not self.kv_quantized:
            return {}
        pick = lambda t: unit if t is None else t  # noqa: E731
        kw = dict(k_scale=pick(k_scale), v_scale=pick(v_scale), q_scale=pick(q_scale))
        if host_scales is not None:
            kw["host_scales"] = (float(host_scales[0]), float(host_scales[1]))
        return kw

    def sink_kwargs(self, sinks: torch.Tensor | None) -> dict:
        """The sink keyword argument of ``Provider.run``: ``{"sinks": sinks}`` for a config with
        :attr:`sinks` (a ``[Hq]`` float32 or model-dtype tensor, required), ``{}`` otherwise (where
        ``sinks`` must be ``None``). ``ValueError`` naming attnplug for a missing, unexpected or
        misshaped tensor (shape and dtype only: no device read)."""
        if not self.sinks:
            if sinks is not None:
                raise ValueError(
                    "attnplug: sinks given for a layer configured without attention sinks (AttentionConfig.sinks=False)"
                )
            return {}
        if sinks is None:
            raise ValueError(
                "attnplug: this layer has attention sinks (AttentionConfig.sinks=True): run() needs sinks=[Hq] tensor"
            )
        if tuple(sinks.shape) != (self.num_qo_heads,) or sinks.dtype not in (torch.float32, self.dtype):
            raise ValueError(
                f"attnplug: sinks must be a [{self.num_qo_heads}] float32 or {self.dtype} "
                f"tensor, got shape {tuple(sinks.shape)} dtype {sinks.dtype}"
            )
        return {"sinks": sinks}

    def kv_cache_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """Shape of one of k_cache / v_cache in this config's layout."""
        if self.kv_layout == "NHD":  # MLA: the latent cache, one head of head_dim (v: its first head_dim_v)
            return (num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return (num_pages, self.num_kv_heads, self.page_size, self.head_dim)
