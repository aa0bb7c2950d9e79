"""attnplug's vLLM v1 attention backends: thin translation onto the core's plan/run.

* ``Backend``: capabilities (what is refused, and why) and the class wiring.
* ``MetadataBuilder.build``: ``CommonAttentionMetadata`` -> core ``BatchMetadata`` -> one
  ``PagedAttention.plan`` per forward for each distinct layer config (shared by its layers).
* CUDA graphs / EAGLE drafting (uniform batches: decode, draft steps, spec verify): the builder
  owns a core ``GraphFamily`` per query length (:class:`UniformGraphs`; a ``GraphState`` per layer config);
  capture, replay-time builds, draft builds and ``update_draft_decode_metadata`` translate
  vLLM's block table + ``seq_lens`` into their static buffers on the device, in place
  (:class:`AttnplugGraphMetadata`). Levels per provider: :func:`graph_level` (from its ``graph_support``).
* ``Impl``: per layer, ``do_kv_cache_update`` scatters the new K/V (the core's ``write_kv_capturable``, no
  host sync: FULL CUDA graphs capture it) and ``forward`` runs the core on NHD views of vLLM's
  KV cache. No attention math here.

Attention sinks (gpt-oss): ``supports_sink`` is the provider class's ``supports_sinks``; a layer's
``sinks [Hq]`` Parameter is kept by reference (weights load after the impl is built) and passed to
every core run; it is part of the layer's core config (``sinks=True``), as its own window is.

Shapes: ``query [T, Hq, D]``, ``key/value [T, Hkv, D]``, ``output [T, Hq, D]``; a layer's
``kv_cache`` is vLLM's ``[num_blocks, Hkv, block_size, 2*D]`` view (see ``compat.split_kv_cache``).

fp8 KV cache (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``, where the provider reads it: its
``KV_DTYPES``): vLLM allocates the cache as uint8 bytes; the impl views them as the fp8 dtype, the KV
write quantizes with saturation and attention dequantizes, both with the layer's own scale tensors
(``compat.layer_kv_scales``: vLLM's ``_k_scale`` / ``_v_scale``, and ``_q_scale`` for fa3's query
quantization): device tensors read by the kernels, so checkpoint scales and in-place updates (0.26's
``--calculate-kv-scales``) apply, and CUDA graphs capture them. Without ``--calculate-kv-scales`` the
impl also passes their floats (``compat.layer_host_kv_scales``, fixed at load; what vLLM's FLASHINFER reads)
as ``host_scales``, which the flashinfer provider folds into FlashInfer's own scale arguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnplug import engine_glue
from attnplug.core import (
    KV_DTYPE_NAMES,
    AttentionConfig,
    BatchMetadata,
    ForwardMode,
    GraphFamily,
    PagedAttention,
    Plan,
    ProviderUnavailable,
    UnsupportedFeature,
    cascade_mode,
    graph_cascade_mode,
    is_fp8,
    kv_dtype_from_name,
    num_pages,
    resolve_provider,
    write_kv_capturable,
)

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

KV_CACHE_DTYPES = ["auto", "float16", "bfloat16"]  # any provider (the model's own dtype)
FP8_CACHE_DTYPES = ["fp8", "fp8_e4m3", "fp8_e5m2"]  # vLLM's names; a provider's KV_DTYPES says which it reads


def kv_cache_dtypes(provider: str) -> list[str]:
    """vLLM ``kv_cache_dtype`` names a core provider can run: the unquantized ones, plus the fp8
    names whose dtype is in the provider's ``KV_DTYPES``."""
    reads = resolve_provider(provider)[1].KV_DTYPES
    return KV_CACHE_DTYPES + [n for n in FP8_CACHE_DTYPES if KV_DTYPE_NAMES[n] in reads]


def fp8_cache_dtype(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The fp8 torch dtype a vLLM ``kv_cache_dtype`` names (its uint8 cache holds these bytes), or ``None``."""
    dt = KV_DTYPE_NAMES.get(kv_cache_dtype or "auto")
    return dt if dt is not None and is_fp8(dt) else None


# Selector flags (vLLM's AttentionSelectorConfig) that change nothing for attnplug.
_HARMLESS_FLAGS = {
    "head_size",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "device_capability",
    "has_sliding_window",
    "use_kv_connector",
}

# Per-process counters, proof that attnplug (not vLLM's own backend) computed attention.
STATS: dict = {
    "pid": os.getpid(),
    "backends": {},
    "builds": 0,
    "graph_builds": 0,
    "layer_runs": 0,
    "kv_writes": 0,
    "prefix_hit_requests": 0,
    "max_cached_prefix": 0,
    "draft_builds": 0,
    "spec_verify_builds": 0,
    "cascade_forwards": 0,
    "cascade_shared_tokens": 0,
    "cascade_graph_updates": 0,
    "cascade_graph_shared_tokens": 0,
}
_LATE = engine_glue.LateCounts()  # decode-graph cascade counters, read without a sync


def write_marker() -> None:
    """Write :data:`STATS` to this process's marker file (``engine_glue.write_marker``)."""
    engine_glue.write_marker("attnplug", STATS)


def refuse_extra(backend: type[AttnplugBackend], what: str, extra: dict) -> None:
    """vLLM's V2 runner forwards builder-specific keyword arguments (``{}`` for attention layers):
    any value attnplug does not know refuses, naming the options."""
    if any(v is not None for v in extra.values()):
        raise backend.refuse(f"{what} {sorted(extra)}")


def uniform_rows(cam) -> tuple[int, int] | None:
    """``(num_reqs, q)`` if every real request of ``cam`` has ``q`` query tokens, possibly padded
    by vLLM (trailing rows with none); else ``None``. Host data only (``query_start_loc_cpu``)."""
    n = cam.num_reqs
    if n < 1 or cam.causal is not True:
        return None
    ql = cam.query_start_loc_cpu[1 : n + 1] - cam.query_start_loc_cpu[:n]
    real = int((ql > 0).sum())
    if real == 0 or bool((ql[real:] != 0).any()) or bool((ql[:real] != ql[0]).any()):
        return None
    q = int(ql[0])
    # padded tokens past num_reqs * q (a vLLM that pads tokens, not requests): padding rows
    return max(n, cam.num_actual_tokens // q if cam.num_actual_tokens % q == 0 else n), q


def layer_attention(
    backend: type[AttnplugBackend],
    vllm_config,
    layer_names,
    kv_cache_spec,
    provider,
    device,
    check: Callable[[AttentionConfig], None] | None = None,
) -> dict[AttentionConfig, PagedAttention]:
    """One ``PagedAttention`` per distinct core config of the layers ``layer_names`` (each impl's
    ``core_config``, kept as its ``core_key``) on ``provider`` (name or class), in the model's dtype
    (the spec's without a model config); ``check(config)`` runs first on each new config. A config
    the core or the provider refuses is refused naming the backend (an unavailable provider: its hint)."""
    model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if not isinstance(model_dtype, torch.dtype):  # no model config (unit tests): the spec's, unquantized
        model_dtype = kv_cache_spec.dtype
    attention: dict[AttentionConfig, PagedAttention] = {}
    for impl in compat.layer_impls(vllm_config, layer_names):
        try:
            cfg = impl.core_key = impl.core_config(kv_cache_spec.block_size, model_dtype)
            if cfg not in attention:
                if check is not None:
                    check(cfg)
                attention[cfg] = PagedAttention(cfg, provider, device)
        except ProviderUnavailable:
            backend.check_available(torch.device(device))  # re-raise with the backend's hint
            raise
        except ValueError as e:  # UnsupportedFeature is a ValueError
            raise backend.refuse(f"this layer configuration: {str(e).removeprefix('attnplug: ')}") from e
    return attention


def announce(backend: type[AttnplugBackend], attention: dict, describe: Callable[[AttentionConfig, object], str]):
    """Log the "active" line of each config of ``attention`` (``describe(config, attn)``, then the
    versions) and record it in :data:`STATS` and the marker file."""
    for cfg, attn in attention.items():
        info = describe(cfg, attn)
        logger.info("attnplug: %s active (%s, %s)", backend.NAME, info, compat.versions_info())
        STATS["backends"].setdefault(backend.NAME, []).append(info)
    write_marker()


class AttnplugBackend(AttentionBackend):
    """Common base of the three backends; subclasses set ``NAME`` and ``PROVIDER``."""

    NAME: ClassVar[str] = ""
    PROVIDER: ClassVar[str] = ""
    IMPL: ClassVar[type]
    BUILDER: ClassVar[type]

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = KV_CACHE_DTYPES
    layer_kv_cache_dtypes: ClassVar[set[str]]  # ``kv_cache_dtype`` of this backend's layers built in this process
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
        """0.26 only (0.32+ takes the shape from the KV cache spec): see ``compat.kv_cache_shape``."""
        return compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
        """0.26 only: physical order of ``get_kv_cache_shape``; see ``compat.kv_cache_stride_order``."""
        return compat.kv_cache_stride_order(include_num_layers_dimension)

    @classmethod
    def preferred_kv_layout(cls) -> str | None:
        """The cache layout (``"NHD"`` / ``"HND"``) this backend's provider reads fastest for this
        process's ``--kv-cache-dtype`` (``Provider.preferred_kv_layout``): from the current vLLM config
        (0.26 asks while it selects the backend), else from this backend's layers built in this
        process (0.32+ asks the worker after the model is built, outside a config); ``None``: no
        preference, or neither source is there (or the layers disagree). Never raises."""
        try:
            kvd = compat.configured_kv_cache_dtype()
            if kvd is None and len(cls.layer_kv_cache_dtypes) == 1:
                (kvd,) = cls.layer_kv_cache_dtypes
            return None if kvd is None else cls.provider_cls().preferred_kv_layout(fp8_cache_dtype(kvd))
        except Exception:  # an unknown provider or dtype name: vLLM's own checks report it
            return None

    @classmethod
    def get_required_kv_cache_layout(cls):
        """0.26: the provider's preferred layout for the process (``compat.required_kv_cache_layout``)."""
        return compat.required_kv_cache_layout(cls.preferred_kv_layout())

    @classmethod
    def supported_kv_cache_layouts(cls):
        """0.32+: layouts this backend reads, the provider's preferred first (``compat.supported_kv_cache_layouts``)."""
        return compat.supported_kv_cache_layouts(cls.preferred_kv_layout())

    @classmethod
    def provider(cls) -> str:
        """Core provider of this backend (``ATTNPLUG_PROVIDER_OVERRIDE`` wins, for debugging)."""
        return engine_glue.provider_for(cls.PROVIDER)

    @classmethod
    def provider_cls(cls):
        """The core provider class of this backend (:meth:`provider`), from the core's registry: the
        selector's class-level questions ask it; a builder resolves it once and passes it down."""
        return resolve_provider(cls.PROVIDER)[1]

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        """Attention sinks (gpt-oss): what the core provider class declares (``Provider.supports_sinks``)."""
        return cls.provider_cls().supports_sinks()

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
            why = cls.kv_cache_dtype_refusal(kvd)
            if why:
                r.append(why)
            elif dtype is not None and kvd in KV_CACHE_DTYPES and kvd != str(dtype).removeprefix("torch."):
                r.append(
                    f"kv_cache_dtype '{kvd}' with model dtype {dtype} (an unquantized KV cache must have "
                    "the model's dtype)"
                )
        if not cls.supports_block_size(bs):
            r.append(f"block_size {bs} (supported: 1..256)")
        cap = cfg.get("device_capability")  # CUDA selection only (vLLM's DeviceCapability)
        if cap is not None and hasattr(cap, "major"):
            why = cls.provider_cls().check_capability(cap.major, getattr(cap, "minor", 0))
            if why:
                r.append(why)
        attn_type = cfg.get("attn_type", AttentionType.DECODER)
        if attn_type != AttentionType.DECODER:
            r.append(f"attention type '{getattr(attn_type, 'value', attn_type)}' (decoder self-attention only)")
        if cfg.get("has_sink") and not cls.supports_sink():
            r.append(f"attention sinks (provider '{cls.provider()}' cannot compute them)")
        names = {
            "use_mla": f"MLA (multi-head latent attention; select {cls.NAME}_MLA for MLA models)",
            "use_sparse": "sparse attention",
            "use_mm_prefix": "bidirectional multimodal-prefix attention",
            "use_per_head_quant_scales": "per-head quantization scales",
            "use_non_causal": "non-causal attention",
            "use_batch_invariant": "batch-invariant mode",
            "use_pcp": "prefill context parallelism",
            "use_dcp": "decode context parallelism",
            "use_rswa": "R-SWA",
            "use_adaptive_verification": "adaptive speculative verification",
        }
        for key, value in cfg.items():
            if value and key not in _HARMLESS_FLAGS and key not in ("attn_type", "has_sink"):
                r.append(names.get(key, f"{key} (unknown to attnplug)"))
        return r

    @classmethod
    def kv_cache_dtype_refusal(cls, kv_cache_dtype: str | None) -> str | None:
        """Why this backend's provider cannot run vLLM ``kv_cache_dtype`` (``None``: it can)."""
        provider = cls.provider()
        ok = kv_cache_dtypes(provider)
        if kv_cache_dtype in (None, *ok):
            return None
        return f"kv_cache_dtype '{kv_cache_dtype}' with provider '{provider}' (supported: {', '.join(ok)})"

    @classmethod
    def validate_configuration(cls, **cfg) -> list[str]:
        """vLLM's selector check (CUDA and others): reasons this config cannot run, each naming the feature."""
        return [f"attnplug {cls.NAME}: unsupported {r}" for r in cls.unsupported_features(**cfg)]

    @classmethod
    def refuse(cls, feature: str) -> UnsupportedFeature:
        return UnsupportedFeature(f"attnplug: backend {cls.NAME} does not support {feature}")

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        """Raise ``ProviderUnavailable`` (the provider's reason and install hint) if the provider
        cannot run on ``device``."""
        try:
            cls.provider_cls().check_available(device)
        except ProviderUnavailable as e:
            why = str(e).removeprefix("attnplug: ")
            raise ProviderUnavailable(f"attnplug: backend {cls.NAME} cannot start on {device.type}: {why}") from e

    @classmethod
    def check_configuration(cls, device: torch.device, **cfg) -> None:
        """Startup check of a selection: unsupported features, then provider availability."""
        reasons = cls.unsupported_features(**cfg)
        if reasons:
            raise cls.refuse("; ".join(reasons))
        cls.check_available(device)


def graph_level(provider: str, mla: bool = False) -> tuple[str, str]:
    """``(vLLM CUDA-graph level, why it is not higher)`` of a core provider, from its ``graph_support``:
    decode, and causal-chain verify replayed from vLLM's device block table (``chain_verify``: device
    refresh, or a host re-plan from host lengths as FlashInfer's) -> ``UNIFORM_BATCH``, which both
    model runners need for FULL graphs of spec-verify batches (mixed prefill/decode batches are never
    captured); decode only -> ``UNIFORM_SINGLE_TOKEN_DECODE``; no decode graphs -> ``NEVER``.
    ``mla``: of the provider's MLA class (``Provider.mla_class``)."""
    cls = resolve_provider(provider)[1]
    g = (cls.mla_class() if mla else cls).graph_support
    if not g.decode:
        return "NEVER", g.reason
    if g.chain_verify:
        return "UNIFORM_BATCH", "mixed prefill/decode batches are not captured (no ALWAYS)"
    return "UNIFORM_SINGLE_TOKEN_DECODE", g.reason or "spec-verify batches are not captured"


VERIFY_SCRATCH_BUDGET = 1 << 30  # bytes of static spec-verify buffers a builder may hold


def verify_scratch_bytes(vllm_config, page_size: int) -> int:
    """Static memory of the spec-verify graph family (``q = 1 + num_speculative_tokens``): the
    core's mask, 1 B per element, ``q * kv capacity``; 0 without speculative decoding."""
    spec = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None) or 0
    if not spec:
        return 0
    max_batch, max_seq_len = compat.graph_limits(vllm_config)
    q, tokens = 1 + int(spec), max_batch * num_pages(max_seq_len, page_size) * page_size
    return q * (tokens + max_batch * (1 + q))


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


class UniformGraphs(GraphFamily):
    """The core's :class:`GraphFamily` of uniform batches of ``q`` query tokens per request over vLLM's
    block table (``q = 1``: decode and draft steps; ``q = 1 + num_speculative_tokens``: spec-decode
    verify, a causal-chain mask), one ``GraphState`` per layer config of ``attention``. A row with
    ``seq_len <= 0`` is a vLLM padding row: the core's padded request on ``pad_page``, vLLM's null block."""

    def __init__(
        self,
        attention,
        provider,
        page_size: int,
        max_batch: int,
        max_seq_len: int,
        device,
        pad_page: int,
        q: int = 1,
        cascade: str = "off",
        refuse=None,
    ):
        super().__init__(
            provider,
            refuse=refuse,
            max_batch=max_batch,
            max_tokens=max_batch * q,
            max_pages=max_batch * num_pages(max_seq_len, page_size),
            device=device,
            mode="decode" if q == 1 else "verify",
            num_draft_tokens=q,
            pad_page=pad_page,
            max_seq_len=max_seq_len,
            cascade=cascade,
            chain=q > 1,
        )
        self.add(attention)

    def refresh(
        self, seq_lens: torch.Tensor, block_table: torch.Tensor, bs: int, host_seq_lens: torch.Tensor | None = None
    ) -> None:
        """``seq_lens [n]`` / ``block_table [n, W]`` (``n <= bs``; rows ``n..bs-1`` padding) into every
        state, in place (:meth:`GraphFamily.refresh_from_block_table`)."""
        self.refresh_from_block_table(seq_lens, block_table, bs, host_seq_lens=host_seq_lens)


@dataclass
class AttnplugGraphMetadata:
    """Metadata of a uniform batch of ``bs`` rows (``q`` tokens each) living in the builder's static
    buffers (CUDA-graph capture / replay, draft steps). ``seq_lens`` / ``block_table`` are the
    vLLM buffers it was built from; ``update_draft_decode_metadata`` re-reads them in place."""

    graphs: UniformGraphs
    bs: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.bs * self.graphs.q

    def plan_for(self, key: AttentionConfig) -> Plan:
        return self.graphs.plan(key, self.bs)

    def run(self, key: AttentionConfig, query, k_cache, v_cache, output, **scales) -> None:
        """``output[:T] = attention(query[:T])``, ``T = bs * q``; launches kernels only (capturable).
        ``scales``: fp8 KV, the layer's scale tensors (``GraphState.run``)."""
        t = self.num_tokens
        self.graphs.run(key, self.bs, query[:t], k_cache, v_cache, output[:t], **scales)


class UniformGraphBuilder:
    """The static state of a metadata builder's uniform batches (GQA and MLA builders): one
    :class:`UniformGraphs` per query length, made on first use. The builder sets ``_level`` (its
    vLLM CUDA-graph level's name), ``_graphs`` (``None``), ``_provider`` (the core provider class),
    ``_graph_cascade_mode``, ``attention`` (its ``PagedAttention`` per config) and ``page_size``."""

    BACKEND: ClassVar[type[AttnplugBackend]]

    def _graph_family(self, q: int) -> UniformGraphs | None:
        """Static state of uniform batches of ``q`` query tokens per request, one core ``GraphState``
        per layer config (created on first use; ``q = 1``: decode and draft steps; ``q = 1 +
        num_speculative_tokens``: spec-decode verify with a causal-chain mask); ``None`` if this
        provider cannot capture them. A row with ``seq_len <= 0`` is a vLLM padding row: it gets the
        core's padded request on ``pad_page``, vLLM's null block."""
        level = self._level
        if level == "NEVER" or (q > 1 and level == "UNIFORM_SINGLE_TOKEN_DECODE"):
            return None
        self._graphs = self._graphs or {}
        if q not in self._graphs:
            max_batch, max_seq_len = compat.graph_limits(self.vllm_config)
            self._graphs[q] = UniformGraphs(
                self.attention,
                self._provider,
                self.page_size,
                max_batch,
                max_seq_len,
                self.device,
                compat.null_block_id(),
                q,
                self._graph_cascade_mode,
                refuse=self.BACKEND.refuse,
            )
        return self._graphs[q]


class AttnplugMetadataBuilder(UniformGraphBuilder, AttentionMetadataBuilder[AttnplugMetadata]):
    """Per KV-cache group: owns one ``PagedAttention`` per distinct layer config and plans it per forward."""

    BACKEND: ClassVar[type[AttnplugBackend]]
    # Set per backend from graph_level(); get_cudagraph_support() also honours ATTNPLUG_PROVIDER_OVERRIDE.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    supports_draft_decode_metadata_update: bool = False  # per instance: True where graphs are

    @classmethod
    def graph_support(cls) -> str:
        """CUDA-graph level of this backend's provider (:func:`graph_level`)."""
        return graph_level(cls.BACKEND.provider())[0]

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """:func:`graph_level` of the provider, lowered to single-token decode when this config's
        spec-verify graphs would need more than ``VERIFY_SCRATCH_BUDGET`` of static buffers."""
        level = cls.graph_support()
        if level == "UNIFORM_BATCH" and vllm_config is not None:
            page = getattr(kv_cache_spec, "block_size", None) or 16
            if verify_scratch_bytes(vllm_config, page) > VERIFY_SCRATCH_BUDGET:
                level = "UNIFORM_SINGLE_TOKEN_DECODE"
        return AttentionCGSupport[level]

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **extra):
        # e.g. block_table_width (requires_block_table_width)
        refuse_extra(self.BACKEND, "metadata-builder options", extra)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        backend = self.BACKEND
        self._graphs: dict[int, UniformGraphs] | None = None  # per q, created on first graph / draft use
        self._level = self.get_cudagraph_support(vllm_config, kv_cache_spec).name
        # a provider that re-plans on the host cannot update drafts in place (in-graph): its drafts build eagerly
        try:
            self._provider = backend.provider_cls()  # resolved once: every core object gets the class
        except ProviderUnavailable:
            backend.check_available(torch.device(device))  # re-raise with the backend's hint
            raise
        graphs = self._provider.graph_support
        self.supports_draft_decode_metadata_update = self._level != "NEVER" and graphs.device_refresh
        spec = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None)
        self._spec_tokens = int(spec or 0)
        self._cascade = cascade_mode() != "off"  # eager forwards may read shared prefixes once
        self._graph_cascade_mode = graph_cascade_mode(graphs, backend.get_name())  # so may decode / verify graphs
        self._graph_cascade = self._graph_cascade_mode != "off"
        self.page_size = kv_cache_spec.block_size
        head_v = getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
        if head_v != kv_cache_spec.head_size:
            raise backend.refuse(f"different K and V head sizes ({kv_cache_spec.head_size} / {head_v})")
        self._provider.prepare_process(torch.device(device).type)
        self.attention = layer_attention(backend, vllm_config, layer_names, kv_cache_spec, self._provider, device)
        announce(
            backend,
            self.attention,
            lambda cfg, attn: (
                f"provider {attn.provider_name}, layout {cfg.kv_layout}, page {cfg.page_size}, "
                f"dtype {str(cfg.dtype).removeprefix('torch.')}, kv_dtype {str(cfg.kv_dtype).removeprefix('torch.')}, "
                f"heads {cfg.num_qo_heads}/{cfg.num_kv_heads}, "
                f"head_dim {cfg.head_dim}, window {cfg.window_left}, sinks {cfg.sinks}, "
                f"soft_cap {cfg.logits_soft_cap}, "
                f"cascade {attn.cascade}, in CUDA graphs {'on (decode, verify)' if self._graph_cascade else 'off'}, "
                f"cache layout {compat.cache_layout_name(vllm_config)}"
            ),
        )

    def _build_eager(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AttnplugMetadata:
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
        cascaded = [p.cascade for p in plans.values() if p.cascade is not None]
        if cascaded:  # shared prefixes read once per group
            STATS["cascade_forwards"] += 1
            STATS["cascade_shared_tokens"] += cascaded[0].shared_tokens
        STATS["builds"] += 1
        write_marker()
        return AttnplugMetadata(batch, self.attention, plans)

    # -- CUDA graphs and EAGLE drafting ------------------------------------------------------------
    def _refuse_graphs(self, what: str) -> UnsupportedFeature:
        provider = self.BACKEND.provider()
        why = graph_level(provider)[1]
        return self.BACKEND.refuse(f"{what} with provider '{provider}' ({why})")

    def _build_graph(self, cam, g: UniformGraphs, bs: int) -> AttnplugGraphMetadata:
        g.plan_for(bs)  # no-op once this bs is planned (replay)
        n = cam.num_reqs
        md = AttnplugGraphMetadata(g, bs, compat.seq_lens(cam)[:n], cam.block_table_tensor[:n])
        host = compat.host_seq_lens(cam, self._spec_tokens == 0) if g.host_lengths else None
        g.refresh(md.seq_lens, md.block_table, bs, host)
        STATS["builds"] += 1
        STATS["graph_builds"] += 1
        counts = g.cascade_counts
        if (
            counts is not None and engine_glue.markers_on()
        ):  # graph updates that cut a shared prefix (first layer config)
            STATS["cascade_graph_updates"], STATS["cascade_graph_shared_tokens"] = _LATE.read(counts)
        write_marker()
        return md

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """Metadata of a (padded) uniform batch in the static buffers, planned for ``num_reqs``
        rows; later ``build`` calls of that shape update the same buffers in place."""
        cam = common_attn_metadata
        level = self._level
        if level == "NEVER":
            raise self._refuse_graphs("CUDA-graph capture")
        shape = uniform_rows(cam)
        g = self._graph_family(shape[1]) if shape else None
        if g is None:
            raise self.BACKEND.refuse(
                f"CUDA-graph capture of this batch (support level {level}: "
                f"{'uniform query lengths' if level == 'UNIFORM_BATCH' else 'single-token decode'} only; "
                f"query_start_loc={cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist()})"
            )
        if shape[0] > g.max_batch:
            raise self.BACKEND.refuse(f"CUDA-graph capture of {shape[0]} requests > max_batch {g.max_batch}")
        return self._build_graph(cam, g, shape[0])

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False, **extra
    ):
        """Captured shapes (replay) update the static buffers in place; so do all single-token
        decode batches that fit them (planned once per batch size) when vLLM V2's fused draft loop
        may ``update_draft_decode_metadata`` what ``build`` returned (speculative decoding) or
        cascade is off. Others: eager plans (where shared prefixes are read once: cascade)."""
        refuse_extra(self.BACKEND, "metadata-builder build() options", extra)
        cam = common_attn_metadata
        shape = uniform_rows(cam)
        if shape is not None:
            bs, q = shape
            if q > 1 and self._spec_tokens and q == 1 + self._spec_tokens:
                STATS["spec_verify_builds"] += 1  # a verify batch of the speculative decoder
            g = self._graph_family(1) if q == 1 else (self._graphs or {}).get(q)
            # every decode bs that fits (V2's fused drafts update them in place); FlashInfer (a wrapper
            # and host plan per bs, no in-place drafts): the captured sizes only
            in_place = self.supports_draft_decode_metadata_update and (
                self._spec_tokens > 0 or not self._cascade or self._graph_cascade
            )
            fits = q == 1 and bs <= g.max_batch and in_place if g else False
            if g is not None and (g.planned(bs) or fits):
                return self._build_graph(cam, g, bs)
        return self._build_eager(common_prefix_len, cam, fast_build)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int):
        """Draft steps after the first are single-token decodes over the real requests: static
        buffers (planned once per batch size), refreshed in place; anything else (and every step
        with FlashInfer, which plans on the host) builds eagerly."""
        STATS["draft_builds"] += 1
        cam = common_attn_metadata
        shape = uniform_rows(cam)
        g = self._graph_family(1) if shape and shape[1] == 1 and self.supports_draft_decode_metadata_update else None
        if g is not None and shape[0] <= g.max_batch:
            return self._build_graph(cam, g, shape[0])
        return self._build_eager(0, cam, True)

    def update_draft_decode_metadata(self, metadata) -> None:
        """Re-read the vLLM buffers ``metadata`` references (``seq_lens``, block table, mutated in
        place by the speculator) into the static buffers: device ops, in place, capture-safe."""
        if not self.supports_draft_decode_metadata_update:
            raise self._refuse_graphs("in-place (capturable) draft metadata updates")
        if not isinstance(metadata, AttnplugGraphMetadata):
            raise self._refuse_graphs("in-place draft metadata update of a non-decode (eager) batch")
        metadata.graphs.refresh(metadata.seq_lens, metadata.block_table, metadata.bs)


class AttnplugImpl(AttentionImpl[AttnplugMetadata]):
    """One attention layer: validates its features at construction, then writes KV and runs the core."""

    BACKEND: ClassVar[type[AttnplugBackend]]

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads=None,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
        **extra,
    ):
        b = self.BACKEND
        if attn_type != AttentionType.DECODER:
            raise b.refuse(
                f"attention type '{getattr(attn_type, 'value', attn_type)}' (encoder, "
                "encoder-only and cross attention are refused; decoder self-attention only)"
            )
        if alibi_slopes is not None:
            raise b.refuse("ALiBi slopes")
        if sinks is not None and not b.supports_sink():
            raise b.refuse(f"attention sinks (provider '{b.provider()}' cannot compute them)")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise b.refuse(f"attention sinks of shape {tuple(sinks.shape)} (one per query head: [{num_heads}])")
        why = b.kv_cache_dtype_refusal(kv_cache_dtype)
        if why:
            raise b.refuse(why)
        b.layer_kv_cache_dtypes.add(kv_cache_dtype)
        unknown = sorted(k for k, v in extra.items() if v)
        if unknown:
            raise b.refuse(f"layer options {unknown}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        # the layer's [Hq] sink logits: the engine's Parameter itself (its weights load after this
        # impl is built, in place), read at each run; None without sinks
        self.sinks = sinks
        self.window_left = sliding_window - 1 if sliding_window else -1  # vLLM's window includes the query
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = fp8_cache_dtype(kv_cache_dtype)  # the bytes of vLLM's uint8 cache, or None
        self.fixed_scales = self.fp8_dtype is not None and not compat.calculates_kv_scales()
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.core_key: AttentionConfig | None = None  # set by the builder
        b.check_available(compat.current_device())

    def core_config(self, page_size: int, dtype: torch.dtype) -> AttentionConfig:
        """The core config of this layer; ``dtype``: the model's (an fp8 cache: ``kv_dtype``)."""
        kv_dtype = kv_dtype_from_name(self.kv_cache_dtype, dtype)
        return AttentionConfig(
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            page_size,
            dtype,
            "NHD",
            self.scale,
            self.logits_soft_cap,
            self.window_left,
            kv_dtype,
            sinks=self.sinks is not None,
        )

    def kv_views(self, kv_cache):
        """``(k_cache, v_cache)`` NHD views of vLLM's layer cache, in the fp8 dtype for an fp8 cache."""
        if self.fp8_dtype is not None and kv_cache.dtype != self.fp8_dtype:
            kv_cache = kv_cache.view(self.fp8_dtype)  # vLLM allocates fp8 caches as uint8
        return compat.split_kv_cache(kv_cache, self.head_size)

    def sink_tensor(self) -> torch.Tensor:
        """The layer's ``[Hq]`` sinks as the core reads them: the live Parameter itself where it is
        float32 or the model dtype, else its float32 cast made at each run (never a copy made at init)."""
        s, cfg = self.sinks, self.core_key
        return s if cfg is None or s.dtype in (torch.float32, cfg.dtype) else s.float()

    def scales(self, layer) -> dict:
        """fp8 KV: the layer's scale tensors (device, read by the kernels), and ``host_scales``, their
        floats (``compat.layer_host_kv_scales``, what vLLM's FLASHINFER reads) unless ``--calculate-kv-scales``
        changes them after graph capture; plus ``sinks`` (the layer's ``[Hq]`` Parameter) for a layer
        with attention sinks; ``{}`` otherwise. Passed to every core run (eager, graph, cascade, draft)."""
        sk = {} if self.sinks is None else {"sinks": self.sink_tensor()}
        if self.fp8_dtype is None:
            return sk
        sc = {**sk, **compat.layer_kv_scales(layer)}
        host = compat.layer_host_kv_scales(layer) if self.fixed_scales else None
        if host is not None:
            sc["host_scales"] = host
        return sc

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Scatter ``key/value [>=T, Hkv, D]`` to ``slot_mapping [T]`` (negative = padding).

        vLLM's FULL CUDA graphs (uniform decode / spec verify) capture this call, so it must not
        sync with the host or depend on data for shapes: :func:`write_kv_capturable`. The CPU
        tests with ``ATTNPLUG_TRITON`` run its GPU kernel through the Triton interpreter."""
        k_cache, v_cache = self.kv_views(kv_cache)
        sc = self.scales(layer)
        write_kv_capturable(
            key, value, k_cache, v_cache, slot_mapping, compat.null_block_id(), sc.get("k_scale"), sc.get("v_scale")
        )
        STATS["kv_writes"] += 1

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        """``output[:T] = attention(query[:T])`` over the paged cache; rows past T are padding."""
        if output_scale is not None or output_block_scale is not None:
            raise self.BACKEND.refuse("fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        k_cache, v_cache = self.kv_views(kv_cache)
        scales = self.scales(layer)
        if isinstance(attn_metadata, AttnplugGraphMetadata):  # static buffers: kernels only
            attn_metadata.run(self.core_key, query, k_cache, v_cache, output, **scales)
            STATS["layer_runs"] += 1
            return output
        attn, plan = attn_metadata.attention_for(self.core_key)
        t = plan.num_tokens
        attn.run(query[:t], k_cache, v_cache, out=output[:t], **scales)
        STATS["layer_runs"] += 1
        return output


def make_backend_class(
    name: str, path: str, provider: str, cache_dtypes: list[str], base: type, impl: type, builder: type, **attrs
) -> type:
    """vLLM backend ``name`` (class path ``path``) on ``base`` for core ``provider`` and the vLLM
    ``kv_cache_dtype`` names ``cache_dtypes``, with its impl and metadata-builder classes (subclasses of
    ``impl`` / ``builder``; the builder's class attributes ``attrs``), made in ``base``'s module (vLLM
    imports them by path)."""
    cls_name = path.rsplit(".", 1)[1]
    ns = {"__module__": base.__module__}
    backend = type(
        cls_name,
        (base,),
        {
            **ns,
            "NAME": name,
            "PROVIDER": provider,
            "supported_kv_cache_dtypes": cache_dtypes,
            "layer_kv_cache_dtypes": set(),
        },
    )
    backend.IMPL = type(cls_name.replace("Backend", "Impl"), (impl,), {**ns, "BACKEND": backend})
    backend.BUILDER = type(
        cls_name.replace("Backend", "MetadataBuilder"), (builder,), {**ns, "BACKEND": backend, **attrs}
    )
    return backend


def _make_backend(name: str) -> type[AttnplugBackend]:
    provider, path = BACKENDS[name]
    level = AttentionCGSupport[graph_level(provider)[0]]  # the default provider's honest level
    return make_backend_class(
        name,
        path,
        provider,
        kv_cache_dtypes(provider),
        AttnplugBackend,
        AttnplugImpl,
        AttnplugMetadataBuilder,
        _cudagraph_support=level,
    )


AttnplugTritonBackend = _make_backend("ATTNPLUG_TRITON")
AttnplugFlashInferBackend = _make_backend("ATTNPLUG_FLASHINFER")
AttnplugFA3Backend = _make_backend("ATTNPLUG_FA3")


def __getattr__(attr: str):
    """The backend class of a provider registered after this module loaded (``AttnplugToyBackend``), made
    on first use; its ``IMPL`` and ``BUILDER`` hang off it."""
    for name, (_, path) in BACKENDS.items():
        if path.rsplit(".", 1)[1] == attr:
            backend = globals()[attr] = _make_backend(name)
            return backend
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


AttnplugTritonImpl, AttnplugFlashInferImpl, AttnplugFA3Impl = (
    b.IMPL for b in (AttnplugTritonBackend, AttnplugFlashInferBackend, AttnplugFA3Backend)
)
AttnplugTritonMetadataBuilder, AttnplugFlashInferMetadataBuilder, AttnplugFA3MetadataBuilder = (
    b.BUILDER for b in (AttnplugTritonBackend, AttnplugFlashInferBackend, AttnplugFA3Backend)
)
