"""attnplug's vLLM v1 attention backends: thin translation onto the core's plan/run.

* ``Backend``: capabilities (what is refused, and why) and the class wiring.
* ``MetadataBuilder.build``: ``CommonAttentionMetadata`` -> core ``BatchMetadata`` -> one
  ``PagedAttention.plan`` per forward for each distinct layer config (shared by its layers).
* ``Impl``: per layer, ``do_kv_cache_update`` scatters the new K/V (core ``write_kv``) and
  ``forward`` runs the core on NHD views of vLLM's KV cache. No attention math here.

Shapes: ``query [T, Hq, D]``, ``key/value [T, Hkv, D]``, ``output [T, Hq, D]``; a layer's
``kv_cache`` is vLLM's ``[num_blocks, Hkv, block_size, 2*D]`` view (see ``compat.split_kv_cache``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnplug.core import (
    AttentionConfig,
    BatchMetadata,
    ForwardMode,
    PagedAttention,
    ProviderUnavailable,
    UnsupportedFeature,
)
from attnplug.core.kv_layout import write_kv
from attnplug.core.plan import Plan
from attnplug.core.providers import get_provider_cls

from . import BACKENDS, compat
from .compat import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

logger = logging.getLogger("vllm.attnplug")

KV_CACHE_DTYPES = ["auto", "float16", "bfloat16"]
INSTALL_HINTS = {
    "triton": "pip install 'triton>=3.2' (on CPU it runs through the Triton interpreter, TRITON_INTERPRET=1)",
    "flashinfer": "it needs a CUDA GPU and FlashInfer: pip install flashinfer-python",
    "fa3": "it needs a Hopper (sm90) CUDA GPU and FlashAttention-3 (flash_attn_interface), built from "
    "https://github.com/Dao-AILab/flash-attention/tree/main/hopper (cd hopper && python setup.py install)",
}
# Selector flags (vLLM's AttentionSelectorConfig) that change nothing for attnplug.
_HARMLESS_FLAGS = {"head_size", "dtype", "kv_cache_dtype", "block_size", "device_capability",
                   "has_sliding_window", "use_kv_connector"}  # fmt: skip

# Per-process counters, proof that attnplug (not vLLM's own backend) computed attention.
STATS: dict = {"pid": os.getpid(), "backends": {}, "builds": 0, "layer_runs": 0, "kv_writes": 0,
               "prefix_hit_requests": 0, "max_cached_prefix": 0}  # fmt: skip


def _write_marker() -> None:
    d = os.environ.get("ATTNPLUG_MARKER_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".attnplug-{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({**STATS, "pid": os.getpid()}, f)
        os.replace(tmp, os.path.join(d, f"attnplug-{os.getpid()}.json"))


class AttnplugBackend(AttentionBackend):
    """Common base of the three backends; subclasses set ``NAME`` and ``PROVIDER``."""

    NAME: ClassVar[str] = ""
    PROVIDER: ClassVar[str] = ""
    IMPL: ClassVar[type]
    BUILDER: ClassVar[type]

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = KV_CACHE_DTYPES
    forward_includes_kv_cache_update: bool = False  # vLLM calls Impl.do_kv_cache_update first

    @classmethod
    def get_name(cls) -> str:
        return cls.NAME

    @classmethod
    def get_impl_cls(cls):
        return cls.IMPL

    @classmethod
    def get_builder_cls(cls):
        return cls.BUILDER

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        """Pre-0.32 vLLM only: ``(2, num_blocks, block_size, Hkv, D)`` (K, V; NHD pages)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def provider(cls) -> str:
        """Core provider of this backend (``ATTNPLUG_PROVIDER_OVERRIDE`` wins, for debugging)."""
        return os.environ.get("ATTNPLUG_PROVIDER_OVERRIDE") or cls.PROVIDER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # plans off the host copy of the query lengths

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= 256

    @classmethod
    def unsupported_features(cls, **cfg) -> list[str]:
        """Every feature of a vLLM ``AttentionSelectorConfig`` (as keyword args) attnplug cannot
        compute, described with its value; ``[]`` when all is supported. Unknown flags that are
        set count as unsupported (a newer vLLM asking for something attnplug never saw)."""
        r = []
        dtype, kvd, bs = cfg.get("dtype"), cfg.get("kv_cache_dtype"), cfg.get("block_size")
        if dtype is not None and dtype not in cls.supported_dtypes:
            r.append(f"dtype {dtype} (supported: float16, bfloat16, float32)")
        if kvd not in (None, "auto"):
            if kvd not in KV_CACHE_DTYPES:
                r.append(f"kv_cache_dtype '{kvd}' (supported: auto, float16, bfloat16; no fp8)")
            elif dtype is not None and kvd != str(dtype).removeprefix("torch."):
                r.append(f"kv_cache_dtype '{kvd}' with model dtype {dtype} (the KV cache must have the model's dtype)")
        if not cls.supports_block_size(bs):
            r.append(f"block_size {bs} (supported: 1..256)")
        attn_type = cfg.get("attn_type", AttentionType.DECODER)
        if attn_type != AttentionType.DECODER:
            r.append(f"attention type '{getattr(attn_type, 'value', attn_type)}' (decoder self-attention only)")
        names = {"use_mla": "MLA (multi-head latent attention)", "has_sink": "attention sinks",
                 "use_sparse": "sparse attention", "use_mm_prefix": "bidirectional multimodal-prefix attention",
                 "use_per_head_quant_scales": "per-head quantization scales", "use_non_causal": "non-causal attention",
                 "use_batch_invariant": "batch-invariant mode", "use_pcp": "prefill context parallelism",
                 "use_dcp": "decode context parallelism", "use_rswa": "R-SWA",
                 "use_adaptive_verification": "adaptive speculative verification"}  # fmt: skip
        for key, value in cfg.items():
            if value and key not in _HARMLESS_FLAGS and key != "attn_type":
                r.append(names.get(key, f"{key} (unknown to attnplug)"))
        return r

    @classmethod
    def validate_configuration(cls, **cfg) -> list[str]:
        """vLLM's selector check (CUDA and others): reasons this config cannot run, each naming the feature."""
        return [f"attnplug {cls.NAME}: unsupported {r}" for r in cls.unsupported_features(**cfg)]

    @classmethod
    def refuse(cls, feature: str) -> UnsupportedFeature:
        return UnsupportedFeature(f"attnplug: backend {cls.NAME} does not support {feature}")

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        """Raise ``ProviderUnavailable`` (with an install hint) if the provider cannot run on ``device``."""
        provider = cls.provider()
        try:
            get_provider_cls(provider).check_available(device)
        except ProviderUnavailable as e:
            hint = "" if "install" in str(e) else f"; {INSTALL_HINTS.get(provider, '')}"
            raise ProviderUnavailable(
                f"attnplug: backend {cls.NAME} cannot start on {device.type}: provider '{provider}' "
                f"is unavailable: {e}{hint}"
            ) from e

    @classmethod
    def check_configuration(cls, device: torch.device, **cfg) -> None:
        """Startup check of a selection: unsupported features, then provider availability."""
        reasons = cls.unsupported_features(**cfg)
        if reasons:
            raise cls.refuse("; ".join(reasons))
        cls.check_available(device)


@dataclass
class AttnplugMetadata:
    """One forward's metadata: the core batch and, per distinct layer config, its planned core object."""

    batch: BatchMetadata
    attention: dict[AttentionConfig, PagedAttention]
    plans: dict[AttentionConfig, Plan]

    def attention_for(self, key: AttentionConfig) -> tuple[PagedAttention, Plan]:
        attn, plan = self.attention[key], self.plans[key]
        if attn.current_plan is not plan:  # another build() ran in between: re-plan this batch
            plan = self.plans[key] = attn.plan(self.batch)
        return attn, plan


class AttnplugMetadataBuilder(AttentionMetadataBuilder[AttnplugMetadata]):
    """Per KV-cache group: owns one ``PagedAttention`` per distinct layer config and plans it per forward."""

    BACKEND: ClassVar[type[AttnplugBackend]]
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        backend = self.BACKEND
        self.page_size = kv_cache_spec.block_size
        head_v = getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
        if head_v != kv_cache_spec.head_size:
            raise backend.refuse(f"different K and V head sizes ({kv_cache_spec.head_size} / {head_v})")
        provider = backend.provider()
        if provider == "triton" and torch.device(device).type == "cpu":
            compat.check_triton_interpreter()
        self.attention: dict[AttentionConfig, PagedAttention] = {}
        for impl in compat.layer_impls(vllm_config, layer_names):
            try:
                cfg = impl.core_key = impl.core_config(self.page_size, kv_cache_spec.dtype)
                if cfg not in self.attention:
                    self.attention[cfg] = PagedAttention(cfg, provider, device)
            except ProviderUnavailable:
                backend.check_available(torch.device(device))  # re-raise with the backend's hint
                raise
            except ValueError as e:  # UnsupportedFeature is a ValueError
                raise backend.refuse(f"this layer configuration: {e}") from e
        for cfg, attn in self.attention.items():
            info = (f"provider {attn.provider_name}, layout {cfg.kv_layout}, page {cfg.page_size}, "
                    f"dtype {str(cfg.dtype).removeprefix('torch.')}, heads {cfg.num_qo_heads}/{cfg.num_kv_heads}, "
                    f"head_dim {cfg.head_dim}, window {cfg.window_left}, soft_cap {cfg.logits_soft_cap}")  # fmt: skip
            logger.info("attnplug: %s active (%s)", backend.NAME, info)
            STATS["backends"].setdefault(backend.NAME, []).append(info)
        _write_marker()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        cam = common_attn_metadata
        if cam.causal is not True:
            raise self.BACKEND.refuse("non-causal attention (CommonAttentionMetadata.causal is not True)")
        n = cam.num_reqs
        qo = cam.query_start_loc_cpu[: n + 1].to(torch.int32)
        q_lens = qo[1:] - qo[:-1]
        mode = ForwardMode.DECODE if n and bool((q_lens == 1).all()) else ForwardMode.MIXED
        batch = BatchMetadata.from_block_table(
            mode, qo, cam.block_table_tensor[:n].to(torch.int32), compat.seq_lens(cam).to(torch.int32), self.page_size
        )
        plans = {cfg: attn.plan(batch) for cfg, attn in self.attention.items()}
        if plans:
            p = next(iter(plans.values()))
            prefix = p.kv_lens_cpu - p.q_lens_cpu
            hits = (p.q_lens_cpu > 1) & (prefix > 0)  # an extend on top of cached KV
            STATS["prefix_hit_requests"] += int(hits.sum())
            STATS["max_cached_prefix"] = max(STATS["max_cached_prefix"], int(prefix[hits].max()) if hits.any() else 0)
        STATS["builds"] += 1
        _write_marker()
        return AttnplugMetadata(batch, self.attention, plans)


class AttnplugImpl(AttentionImpl[AttnplugMetadata]):
    """One attention layer: validates its features at construction, then writes KV and runs the core."""

    BACKEND: ClassVar[type[AttnplugBackend]]

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **extra):  # fmt: skip
        b = self.BACKEND
        if attn_type != AttentionType.DECODER:
            raise b.refuse(f"attention type '{getattr(attn_type, 'value', attn_type)}' (encoder, "
                           "encoder-only and cross attention are refused; decoder self-attention only)")  # fmt: skip
        if alibi_slopes is not None:
            raise b.refuse("ALiBi slopes")
        if sinks is not None:
            raise b.refuse("attention sinks")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise b.refuse(f"kv_cache_dtype '{kv_cache_dtype}' (supported: auto, float16, bfloat16; no fp8)")
        unknown = sorted(k for k, v in extra.items() if v)
        if unknown:
            raise b.refuse(f"layer options {unknown}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.window_left = sliding_window - 1 if sliding_window else -1  # vLLM's window includes the query
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.core_key: AttentionConfig | None = None  # set by the builder
        b.check_available(compat.current_device())

    def core_config(self, page_size: int, dtype: torch.dtype) -> AttentionConfig:
        return AttentionConfig(self.num_heads, self.num_kv_heads, self.head_size, page_size, dtype, "NHD",
                               self.scale, self.logits_soft_cap, self.window_left)  # fmt: skip

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Scatter ``key/value [>=T, Hkv, D]`` to ``slot_mapping [T]`` (negative = padding)."""
        k_cache, v_cache = compat.split_kv_cache(kv_cache, self.head_size)
        n = slot_mapping.shape[0]
        write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping, "NHD")
        STATS["kv_writes"] += 1

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        """``output[:T] = attention(query[:T])`` over the paged cache; rows past T are padding."""
        if output_scale is not None or output_block_scale is not None:
            raise self.BACKEND.refuse("fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        attn, plan = attn_metadata.attention_for(self.core_key)
        k_cache, v_cache = compat.split_kv_cache(kv_cache, self.head_size)
        t = plan.num_tokens
        attn.run(query[:t], k_cache, v_cache, out=output[:t])
        STATS["layer_runs"] += 1
        return output


def _make_backend(name: str) -> type[AttnplugBackend]:
    provider, path = BACKENDS[name]
    cls_name = path.rsplit(".", 1)[1]
    ns = {"__module__": __name__}
    backend = type(cls_name, (AttnplugBackend,), {**ns, "NAME": name, "PROVIDER": provider})
    backend.IMPL = type(cls_name.replace("Backend", "Impl"), (AttnplugImpl,), {**ns, "BACKEND": backend})
    backend.BUILDER = type(
        cls_name.replace("Backend", "MetadataBuilder"), (AttnplugMetadataBuilder,), {**ns, "BACKEND": backend}
    )
    return backend


AttnplugTritonBackend = _make_backend("ATTNPLUG_TRITON")
AttnplugFlashInferBackend = _make_backend("ATTNPLUG_FLASHINFER")
AttnplugFA3Backend = _make_backend("ATTNPLUG_FA3")
AttnplugTritonImpl, AttnplugFlashInferImpl, AttnplugFA3Impl = (
    b.IMPL for b in (AttnplugTritonBackend, AttnplugFlashInferBackend, AttnplugFA3Backend)
)
AttnplugTritonMetadataBuilder, AttnplugFlashInferMetadataBuilder, AttnplugFA3MetadataBuilder = (
    b.BUILDER for b in (AttnplugTritonBackend, AttnplugFlashInferBackend, AttnplugFA3Backend)
)
