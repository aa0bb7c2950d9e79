"""``AttnplugAttnBackend``: SGLang's ``AttentionBackend`` contract over attnplug's ``PagedAttention``.

Thin by design: SGLang owns the pools (``req_to_token [slots, max_ctx]`` token table and the
per-layer token pool ``k_buffer/v_buffer [size + page_size, Hkv, D]``, NHD); this class

* plans once per forward (``init_forward_metadata``): SGLang batch -> ``BatchMetadata`` (CSR page
  table over ``req_to_token``, query lengths, TARGET_VERIFY custom mask) -> ``PagedAttention.plan``;
* per layer writes the new K/V through ``token_to_kv_pool.set_kv_buffer`` and calls
  ``PagedAttention.run`` on the pool viewed as pages ``[num_pages, page_size, Hkv, D]``.

CUDA graphs (DECODE, TARGET_VERIFY): ``init_cuda_graph_state`` sizes one core ``GraphState`` per
mode and layer config once; ``init_forward_metadata_out_graph(fb, in_capture=True)`` plans the padded
batch SGLang captures, a replay rewrites the static buffers in place (``GraphState.update``). SGLang
pads requests with ``seq_len = get_cuda_graph_seq_len_fill_value()`` = the core's ``FILL_SEQ_LEN``
(1); the padded requests' metadata comes from the core's fill values, never from ``req_to_token``.
EAGLE multi-step draft: ``draft.AttnplugMultiStepDraftBackend`` (its ``attn_backends`` are subclasses
of this class).

fp8 KV pool (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``: the pool's dtype): the adapter writes the new
K/V itself (``x / scale`` saturated to the fp8 range, as attnplug's vLLM write; SGLang's pool would
cast without saturation): one Triton launch into the pool's pages where Triton runs, else quantized
in torch and stored by ``set_kv_buffer``;
attention dequantizes with the same scales: ``layer.k_scale`` / ``layer.v_scale`` (tensors SGLang's
KV-cache quant method loads from a checkpoint), 1 when the layer has none - as SGLang's own backends;
their floats (``layer.k_scale_float``, fixed at load) go along as ``host_scales``, which the
flashinfer provider hands to FlashInfer as SGLang's flashinfer backend does.

Attention sinks (gpt-oss passes ``sinks=`` [Hq] to the backend's forward): handed to the core's run
(eager, graphs, draft steps) at each call, so in-place updates apply; refused by name where the
provider class declares none (``supports_sinks``). Each layer's ``sliding_window_size`` (SGLang's
``window_left``) and its sinks are part of its config key: window and full layers get their own plans.

All math is the core's. Whatever the core or this adapter cannot compute is refused with an
``UnsupportedFeature`` naming attnplug, the backend and the feature: at startup (constructor) when
the model says so, else at the first forward that needs it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from attnplug import engine_glue
from attnplug.core import (
    FILL_SEQ_LEN,
    FP8_KV_DTYPES,
    MAX_PAGE_SIZE,
    AttentionConfig,
    BatchMetadata,
    GraphFamily,
    PagedAttention,
    ProviderUnavailable,
    UnsupportedFeature,
    csr_from_req_to_token,
    graph_cascade_mode,
    num_pages,
    resolve_provider,
    write_kv_capturable,
)
from attnplug.core import (
    ForwardMode as CoreMode,
)

from . import compat

if TYPE_CHECKING:
    from attnplug.core.providers import GraphSupport

logger = logging.getLogger(__name__)


@dataclass
class _Stats:
    """What the marker file records: proof that this backend (not another) computed attention."""

    forwards: dict[str, int] = field(default_factory=dict)  # planned forwards per SGLang mode
    layer_runs: int = 0  # PagedAttention.run calls
    max_cached_prefix: int = 0  # longest KV prefix an EXTEND query read from the cache
    max_kv_len: int = 0
    cascade_forwards: int = 0  # forwards that read shared prefixes once per group (cascade)
    cascade_shared_tokens: int = 0  # KV tokens those forwards did not read again
    cascade_graph_updates: int = 0  # decode-graph replays whose update cut a shared prefix (read late)
    cascade_graph_shared_tokens: int = 0  # KV tokens those replays did not read again


def passed_args(kwargs: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """The names of the attention arguments SGLang actually passed (not ``None`` / ``False``) beyond ``allowed``."""
    return sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in allowed)


class AttnplugAttnBackend(AttentionBackend):
    """SGLang attention backend ``attnplug_<provider>``.

    Args:
        model_runner: SGLang's ``ModelRunner`` (pools, translator, configs are taken from it).
        backend_name: ``attnplug_triton`` / ``attnplug_flashinfer`` / ``attnplug_fa3``.
        provider: core provider; default derived from ``backend_name`` (or ``$ATTNPLUG_PROVIDER_OVERRIDE``).

    Raises:
        UnsupportedFeature: the model / pool needs something attnplug does not do (yet).
        ProviderUnavailable: the provider cannot run here (message carries an install hint).
    """

    def __init__(self, model_runner, backend_name: str = "attnplug_triton", provider: str | None = None):
        super().__init__()
        from attnplug.sglang_adapter import BACKENDS

        self.backend_name = backend_name
        self.device = torch.device(model_runner.device)
        try:  # resolved once: every core object gets the class
            self.provider_name, self.provider = resolve_provider(provider or BACKENDS[backend_name], provider)
        except ProviderUnavailable as e:
            raise self._cannot_start(e) from e
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise self.unsupported(f"page size {self.page_size} (--page-size; supported: 1..{MAX_PAGE_SIZE})")
        self._check_model(model_runner)
        self._extend_modes = compat.extend_like_modes()

        pool = self.token_to_kv_pool
        self.num_kv_heads, self.head_dim = self._pool_dims()
        self.dtype, self.kv_dtype = model_runner.dtype, pool.dtype  # kv_dtype: the model's or fp8
        mc = model_runner.model_config
        self.num_qo_heads = int(mc.get_num_attention_heads(compat.attn_tp_size()))
        slots = int(pool.get_key_buffer(getattr(pool, "start_layer", 0)).shape[0])
        if slots % self.page_size:
            raise self.unsupported(
                f"a KV pool of {slots} slots that is not a whole number of pages of {self.page_size}"
            )
        self.num_pages = slots // self.page_size
        # SGLang's EAGLE worker sizes a verify tree mask with ``bs * attn_backend.max_context_len``
        # when a batch carries no seq_lens_sum (0.5.17 and 0.5.23 read it off any target backend).
        self.max_context_len = int(self.req_to_token_pool.req_to_token.shape[1])

        self.provider.prepare_process(self.device.type)  # too late only if triton was imported

        self._configs: dict[tuple, AttentionConfig] = {}  # a layer's fields -> its core config
        self._attn: dict[AttentionConfig, PagedAttention] = {}  # one per distinct layer config
        self._planned: dict[AttentionConfig, int] = {}  # config -> forward id its plan belongs to
        self._checked_layers: set[int] = set()
        self._forward_id = 0
        self._batch = None  # BatchMetadata of the current forward
        self._runner = model_runner
        self._graphs: dict[str, GraphFamily] | None = None  # "decode" / "verify" / "draft_extend" families
        self._graph_cfg: dict = {}
        self._graph_fwd = None  # (mode, bs) of the current CUDA-graph forward
        self.graph_refusal: str | None = None  # graphs refused, and why (shown at init_cuda_graph_state)
        self.draft_extend = False  # set by the EAGLE draft-extend factory: graphs of DRAFT_EXTEND(_V2) batches
        self._stats = _Stats()
        self._late_counts = engine_glue.LateCounts()  # decode-graph cascade counters, read without a sync
        # Build the provider now: an unavailable provider or unsupported config fails at startup.
        self.probe_config = self._config((self.num_qo_heads, self.num_kv_heads, self.head_dim, None, 0.0, -1, False))
        probe = self._new_attention(self.probe_config)  # not kept: the layers' configs are planned
        self._supports_sinks = self.provider.supports_sinks()  # the provider class declares it
        logger.info(
            "attnplug: %s active (provider %s, page %d, layout NHD, dtype %s, heads %d/%d, head_dim %d, cascade %s, "
            "in CUDA graphs %s, %s%s)",
            self.backend_name,
            probe.provider_name,
            self.page_size,
            str(self.dtype).replace("torch.", ""),
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            probe.cascade,
            "on (decode, verify)" if graph_cascade_mode(self.graph_support(), self.backend_name) != "off" else "off",
            compat.versions_info(),
            f", kv_dtype {str(self.kv_dtype).replace('torch.', '')}" if self.kv_dtype != self.dtype else "",
        )
        self._write_marker()

    # -- startup checks -----------------------------------------------------------------------------
    def unsupported(self, feature: str) -> UnsupportedFeature:
        """The refusal of ``feature``, naming attnplug and this backend (raise it)."""
        return UnsupportedFeature(f"attnplug: backend '{self.backend_name}' does not support {feature}")

    def _cannot_start(self, e: ProviderUnavailable) -> ProviderUnavailable:
        why = str(e).removeprefix("attnplug: ")
        return ProviderUnavailable(f"attnplug: backend '{self.backend_name}' cannot start on {self.device}: {why}")

    def _pool_dims(self) -> tuple[int, int]:
        """``(KV heads, head dim)`` of the pool's rows."""
        return int(self.token_to_kv_pool.head_num), int(self.token_to_kv_pool.head_dim)

    def _head_dim_v(self) -> int:
        """The value head dim the layers must have (GQA / MHA: the qk head dim)."""
        return self.head_dim

    def _serves_layer(self, layer) -> bool:
        """Whether ``layer`` (a ``RadixAttention``) runs through this backend (GQA / MHA: every one)."""
        return True

    def _check_model(self, runner) -> None:
        mc = runner.model_config
        if getattr(mc, "is_encoder_decoder", False):
            raise self.unsupported("encoder-decoder models (cross attention)")
        self._check_arch_and_pool(runner)
        self._check_pool(runner)

    def _check_arch_and_pool(self, runner) -> None:
        """The model's attention family and its pool class: GQA / MHA over the plain token pool
        (MLA models get :class:`~attnplug.sglang_adapter.mla.AttnplugMLAAttnBackend`)."""
        arch = getattr(runner.model_config, "attention_arch", None)
        if arch is not None and getattr(arch, "name", "") == "MLA":
            raise self.unsupported("MLA (multi-head latent attention) models")
        if getattr(runner, "is_draft_worker", False):
            refusal = compat.draft_hook_refusal()
            if refusal is not None:
                raise UnsupportedFeature(f"{refusal} (backend '{self.backend_name}' on the draft model)")
        pool_cls = compat.plain_mha_pool_cls()
        if type(self.token_to_kv_pool) is not pool_cls:
            name = type(self.token_to_kv_pool).__name__
            hint = (
                (
                    "; start SGLang with --disable-hybrid-swa-memory: one pool for every layer, each layer's window "
                    "applied in attention"
                )
                if "SWA" in name
                else ""
            )
            raise self.unsupported(
                f"the KV pool {name} (only {pool_cls.__name__}: no hybrid sliding-window/mamba, "
                f"MLA, quantized or page-major pools){hint}"
            )

    def _check_pool(self, runner) -> None:
        """The pool's quantization, layout and dtypes, the index translation, context parallelism."""
        if getattr(self.token_to_kv_pool, "is_quantized_kv_cache", False):  # a KV quant method owns the bytes
            qm = getattr(getattr(self.token_to_kv_pool, "quant_method", None), "name", "?")
            raise self.unsupported(
                f"a quantized KV pool (quant method {qm!r}: the pool quantizes and scales "
                "itself; attnplug reads plain fp8 pools with per-layer scales)"
            )
        layout = getattr(self.token_to_kv_pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise self.unsupported(f"KV cache layout {layout!r} (only 'nhd')")
        kv_dtype = getattr(runner, "kv_cache_dtype", self.token_to_kv_pool.dtype)
        plain = kv_dtype == runner.dtype and kv_dtype in (torch.float16, torch.bfloat16, torch.float32)
        if not plain and kv_dtype not in FP8_KV_DTYPES:
            raise self.unsupported(
                f"KV cache dtype {kv_dtype} with model dtype {runner.dtype} "
                "(the model's dtype, fp8_e4m3 or fp8_e5m2 only)"
            )
        if self.token_to_kv_pool.dtype != kv_dtype:
            raise self.unsupported(f"a KV pool of dtype {self.token_to_kv_pool.dtype} for kv_cache_dtype {kv_dtype}")
        tr = self.kv_index_translator
        if tr is not None and getattr(tr, "reads_are_translated", False):
            raise self.unsupported("translated (unified / virtual->physical) KV pools")
        if compat.attn_dcp_size() > 1:
            raise self.unsupported("decode context parallelism (attn_dcp_size > 1)")

    def _check_layer(self, layer, kwargs) -> torch.Tensor | None:
        """Refuse what this layer asks that attnplug cannot compute; returns its ``sinks [Hq]`` (the
        tensor SGLang passes, e.g. gpt-oss's Parameter: read live at each run) or ``None``."""
        sinks = kwargs.get("sinks")
        extra = passed_args(kwargs, allowed=("sinks",))
        if extra:
            raise self.unsupported(f"attention arguments {extra} (e.g. score_mod)")
        if sinks is not None and not self._supports_sinks:
            raise self.unsupported(f"attention sinks (provider '{self.provider_name}' cannot compute them)")
        if layer.layer_id in self._checked_layers:
            return sinks
        if sinks is not None and tuple(sinks.shape) != (layer.tp_q_head_num,):
            raise self.unsupported(
                f"attention sinks of shape {tuple(sinks.shape)} (one per query head: [{layer.tp_q_head_num}])"
            )
        from sglang.srt.layers.radix_attention import AttentionType

        if layer.is_cross_attention:
            raise self.unsupported("cross attention")
        if layer.attn_type != AttentionType.DECODER:
            raise self.unsupported(f"non-causal attention ({layer.attn_type})")
        if layer.v_head_dim != self._head_dim_v():
            raise self.unsupported(f"qk_head_dim {layer.qk_head_dim} with v_head_dim {layer.v_head_dim}")
        if (layer.tp_k_head_num, layer.qk_head_dim) != (self.num_kv_heads, self.head_dim):
            raise self.unsupported(f"layer {layer.layer_id} KV shape differing from the pool's")
        if layer.logit_cap and layer.logit_cap > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            raise self.unsupported(f"logit capping method {layer.logit_capping_method!r} (only tanh)")
        if getattr(layer, "use_irope", False):
            raise self.unsupported("chunked local attention (iRoPE)")
        if getattr(layer, "xai_temperature_len", -1) > 0:
            raise self.unsupported("xai temperature scaling")
        self._checked_layers.add(layer.layer_id)
        return sinks

    # -- per-config core objects --------------------------------------------------------------------
    def _config(self, key: tuple) -> AttentionConfig:
        """The core config of ``key = (Hq, Hkv, D, sm_scale, soft_cap, window_left, sinks)`` (cached)."""
        cfg = self._configs.get(key)
        if cfg is None:
            try:
                cfg = self._core_config(key)
            except ValueError as e:  # a head count / head dim / dtype the core cannot describe
                raise self.unsupported(f"this layer configuration ({str(e).removeprefix('attnplug: ')})") from e
            cfg = self._configs[key] = cfg
        return cfg

    def _core_config(self, key: tuple) -> AttentionConfig:
        """A new core config of ``key = (Hq, Hkv, D, sm_scale, soft_cap, window_left, sinks)``."""
        hq, hkv, d, scale, cap, window, sinks = key
        return AttentionConfig(
            hq, hkv, d, self.page_size, self.dtype, "NHD", scale, cap, window, self.kv_dtype, sinks=sinks
        )

    def attention(self, config: AttentionConfig) -> PagedAttention:
        """The ``PagedAttention`` of ``config`` (one per distinct layer config, usually one), built on
        first use: an unavailable provider or unsupported config is refused naming this backend."""
        attn = self._attn.get(config)
        if attn is None:
            attn = self._attn[config] = self._new_attention(config)
        return attn

    def _new_attention(self, config: AttentionConfig) -> PagedAttention:
        try:
            return PagedAttention(config, provider=self.provider, device=self.device)
        except ProviderUnavailable as e:  # the provider's reason and install hint
            raise self._cannot_start(e) from e
        except UnsupportedFeature as e:  # e.g. an fp8 dtype the provider does not read
            raise self.unsupported(f"this configuration ({str(e).removeprefix('attnplug: ')})") from e

    def layer_config(self, layer, sinks: bool = False) -> AttentionConfig:
        """The core config of ``layer``: each layer's own window (``sliding_window_size``, SGLang's
        ``window_left``; gpt-oss alternates 127 and -1) and whether it passes ``sinks``."""
        cap = float(layer.logit_cap) if layer.logit_cap and layer.logit_cap > 0 else 0.0
        window = int(layer.sliding_window_size) if layer.sliding_window_size is not None else -1
        return self._config(
            (
                layer.tp_q_head_num,
                layer.tp_k_head_num,
                layer.qk_head_dim,
                float(layer.scaling),
                cap,
                max(window, -1),
                sinks,
            )
        )

    # -- metadata: once per forward -------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """Build this forward's ``BatchMetadata`` and plan every core object once."""
        self._plan_forward(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """CUDA-graph metadata, outside the graph (SGLang calls it before capture and before replay).

        Without :meth:`init_cuda_graph_state` (or for a mode not captured) this is the eager metadata
        step. With graph state: ``in_capture`` plans the padded batch of ``bs = batch_size`` requests
        (``bs - num_padding`` real ones, the rest SGLang's padding) once per ``bs`` into the static
        buffers of the core's ``GraphState``; a replay writes the real requests into those buffers in
        place, padded slots refilled with the fill values, no device->host read: a DECODE replay in one
        launch from ``req_to_token`` (``GraphState.update_from_block_table``; FlashInfer's host plan
        takes its lengths from ``seq_lens_cpu``), a TARGET_VERIFY replay the same way with SGLang's tree
        masks where the provider refreshes on the device; else through ``GraphState.update``, host
        shapes from ``seq_lens_cpu``. Decode and verify graphs read shared prefixes once (cascade).
        """
        mode = self._graph_mode_of(forward_batch)
        if mode == "draft_extend" and self._graphs is not None and mode in self._graphs:
            self._draft_extend_graph_metadata(forward_batch)
            return
        if self._graphs is None or mode not in self._graphs:
            if in_capture:
                what = "this forward mode" if self._graphs is not None else "capture without init_cuda_graph_state"
                raise self.unsupported(
                    f"CUDA-graph {what} ({forward_batch.forward_mode.name}); "
                    "attnplug captures DECODE, TARGET_VERIFY and, on the EAGLE draft-extend "
                    "backend, DRAFT_EXTEND"
                )
            self._plan_forward(forward_batch)
            return
        bs = int(forward_batch.batch_size)
        real = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        self._forward_id += 1
        self._batch = None
        family = self._graphs[mode]
        if not family:  # no layer config known yet: the probe's (layers add theirs lazily)
            family.state(self.probe_config)
        host_plan = family.host_lengths
        host_seq = getattr(forward_batch, "seq_lens_cpu", None)
        host_seq = host_seq[:real] if host_seq is not None and host_plan else None
        # Decode replays from req_to_token on the device, in one launch per layer config; a provider
        # that plans on the host then plans from seq_lens_cpu and that launch's device kv_indices.
        # TARGET_VERIFY replays the same way, SGLang's tree masks copied in that launch, where the
        # provider refreshes on the device. The host path below stays for capture, a host-planning
        # provider's TARGET_VERIFY and a host-planning provider when SGLang gives no seq_lens_cpu.
        fast = (mode == "decode" and (not host_plan or host_seq is not None)) or (mode == "verify" and not host_plan)
        if fast and not in_capture and family.planned(bs):
            ids, rows = self._read_table(forward_batch, real)
            seq, mask = forward_batch.seq_lens[:real], None
            if mode == "verify":
                mask = getattr(forward_batch.spec_info, "custom_mask", None)  # None: causal chains
                seq, mask = seq + self._verify_q(forward_batch), None if mask is None else mask.reshape(-1)
            family.refresh_from_block_table(
                seq, ids, bs, row_ids=rows, entry_tokens=self.page_size, host_seq_lens=host_seq, custom_mask=mask
            )
        else:
            batch = self._graph_batch(forward_batch, mode, real, host=in_capture, host_plan=host_plan)
            family.set_batch(bs, batch, capture=in_capture)
        self._graph_fwd = (mode, bs)
        st = self._stats
        key = "GRAPH_" + forward_batch.forward_mode.name
        st.forwards[key] = st.forwards.get(key, 0) + 1
        counts = family.cascade_counts
        if counts is not None and engine_glue.markers_on():  # replays that cut a shared prefix (first layer config)
            new = self._late_counts.read(counts)
            if new != [st.cascade_graph_updates, st.cascade_graph_shared_tokens]:
                st.cascade_graph_updates, st.cascade_graph_shared_tokens = new
                self._write_marker()

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record: all planning is host-side, in ``init_forward_metadata_out_graph``."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Size the graph state once: DECODE (``max_num_tokens == max_bs``) or TARGET_VERIFY with
        ``q = max_num_tokens // max_bs`` draft tokens per request; one core ``GraphState`` per
        distinct layer config (from the model's ``RadixAttention`` layers, else lazily at warmup).

        Raises:
            UnsupportedFeature: the provider cannot replay these batches (its ``graph_support`` says
                why), or its verify cannot run with this config (``fa3`` with a sliding window).
        """
        if self.graph_refusal:
            raise self.unsupported(f"{self.graph_refusal}; start SGLang with --disable-cuda-graph")
        self.check_graph_support()
        q = max(1, int(max_num_tokens) // max(1, int(max_bs)))
        ctx = int(self.req_to_token_pool.req_to_token.shape[1])
        self._graph_cfg = dict(max_bs=int(max_bs), q=q, ctx=ctx)
        configs = list(self.model_layer_configs()) or [self.probe_config]
        if self.draft_extend:  # EAGLE draft extend: q = the tree width per request, causal chains
            self._graphs = {"draft_extend": self._graph_family("draft_extend").add(configs)}
            return
        self._graphs = {"decode": self._graph_family("decode").add(configs)}
        spec = getattr(self._runner, "spec_algorithm", None)  # SGLang captures TARGET_VERIFY only with spec on
        verify = q > 1 and (spec is None or not getattr(spec, "is_none", lambda: False)())
        self._graphs["verify"] = self._graph_family("verify").add(configs if verify else ())

    def graph_support(self) -> GraphSupport:
        """What CUDA graphs of this backend's configs replay: the ``graph_support`` of the provider class
        that serves them (GQA / MHA: the provider's own class)."""
        return self.provider.graph_support

    def check_graph_support(self) -> None:
        """Refuse CUDA graphs at once when the provider cannot replay decode batches (it says why)."""
        g = self.graph_support()
        if not g.decode:
            raise self.unsupported(
                f"CUDA graphs with provider '{self.provider_name}' ({g.reason}); start SGLang with --disable-cuda-graph"
            )

    def refuse_graphs(self, what: str) -> UnsupportedFeature:
        """The refusal of ``what`` in CUDA graphs (a :class:`GraphFamily`'s ``refuse``)."""
        return self.unsupported(f"{what}; start SGLang with --disable-cuda-graph")

    def _graph_family(self, mode: str) -> GraphFamily:
        """The graph family of ``mode`` (``decode`` / ``verify`` / ``draft_extend``), sized from
        :meth:`init_cuda_graph_state`'s limits; its states join per layer config."""
        c = self._graph_cfg
        q = 1 if mode == "decode" else c["q"]
        cascade = graph_cascade_mode(self.graph_support(), self.backend_name) if mode != "draft_extend" else "off"
        return GraphFamily(
            self.provider,
            refuse=self.refuse_graphs,
            max_batch=c["max_bs"],
            max_tokens=c["max_bs"] * q,
            max_pages=c["max_bs"] * num_pages(c["ctx"] + q, self.page_size),
            device=self.device,
            mode="decode" if mode == "decode" else "verify",
            num_draft_tokens=q,
            pad_page=0,
            max_seq_len=c["ctx"] + q,
            cascade=cascade,
            chain=mode == "draft_extend",
        )

    def model_layer_configs(self) -> dict[AttentionConfig, None]:
        """The core configs of the model's ``RadixAttention`` layers, in order (empty without a model)."""
        model = getattr(self._runner, "model", None)
        if model is None or not hasattr(model, "modules"):
            return []
        from sglang.srt.layers.radix_attention import RadixAttention

        # a layer with sinks: its RadixAttention is a child of a module holding the ``sinks`` tensor it
        # passes at forward (gpt-oss: ``self.attn(..., sinks=self.sinks)``)
        with_sinks = {
            id(c)
            for m in model.modules()
            if isinstance(getattr(m, "sinks", None), torch.Tensor)
            for c in m.children()
            if isinstance(c, RadixAttention)
        }
        return dict.fromkeys(
            self.layer_config(m, id(m) in with_sinks)
            for m in model.modules()
            if isinstance(m, RadixAttention) and self._serves_layer(m)
        )

    def _graph_mode_of(self, fb):
        m = fb.forward_mode
        if m.is_target_verify():
            return "verify"
        if m.is_decode():
            return "decode"
        if self._extend_modes.get(m) == "DRAFT_EXTEND":
            return "draft_extend"
        return None

    def _draft_extend_graph_metadata(self, fb) -> None:
        """EAGLE draft extend in CUDA graphs (SGLang's ``EAGLEDraftExtendCudaGraphRunner``): every request
        runs the tree width ``W`` of tokens (padded), after a prefix of ``seq_lens - extend_seq_lens``
        keys, causally: a uniform causal-chain batch of ``q = W`` over ``kv_len = seq_lens -
        extend_seq_lens + W``, refreshed from ``req_to_token`` on the device in one launch per layer
        config (``GraphState(chain=True).update_from_block_table``; a host-planning provider plans from
        ``seq_lens_cpu`` and ``extend_seq_lens_cpu``). SGLang's padded rows (``seq_lens`` = the fill
        value, ``W`` tokens) come out shorter than ``W`` and become the core's padded requests."""
        bs, W = int(fb.batch_size), self._graph_cfg["q"]
        self._forward_id += 1
        self._batch = None
        ext = getattr(fb.spec_info, "extend_seq_lens_tensor", None)
        ext = ext if ext is not None else getattr(fb, "extend_seq_lens", None)
        seq = fb.seq_lens[:bs] + (W - ext[:bs]) if ext is not None else fb.seq_lens[:bs]
        seq = torch.where(seq > W, seq, torch.zeros_like(seq)).to(torch.int32)  # > W: a real request
        family = self._graphs["draft_extend"]
        host = None
        if family.host_lengths:
            h = getattr(fb, "seq_lens_cpu", None)
            h = h[:bs] if h is not None else fb.seq_lens[:bs].cpu()
            e = getattr(fb.spec_info, "extend_seq_lens_cpu", None) or getattr(fb, "extend_seq_lens_cpu", None)
            h = h + W - torch.tensor(list(e)[:bs], dtype=h.dtype) if e is not None else h
            host = torch.where(h > W, h, torch.zeros_like(h)).to(torch.int32)
        ids, rows = self._read_table(fb, bs)
        family.refresh_from_block_table(seq, ids, bs, row_ids=rows, entry_tokens=self.page_size, host_seq_lens=host)
        self._graph_fwd = ("draft_extend", bs)
        key = "GRAPH_" + fb.forward_mode.name
        self._stats.forwards[key] = self._stats.forwards.get(key, 0) + 1

    def _verify_q(self, fb) -> int:
        """The draft tokens a request of a TARGET_VERIFY graph batch (refused unless the graph state's ``q``)."""
        spec = fb.spec_info
        q = spec.num_tokens_per_req if getattr(spec, "num_tokens_per_req", -1) > 0 else spec.draft_token_num
        if q != self._graph_cfg["q"]:
            raise self.unsupported(
                f"a TARGET_VERIFY graph batch of {q} draft tokens per request (graph state "
                f"sized for {self._graph_cfg['q']} = max_num_tokens // max_bs)"
            )
        return q

    def _graph_batch(self, fb, mode: str, B: int, host: bool, host_plan: bool):
        """``BatchMetadata`` of the ``B`` real requests of a graph batch, built without reading device
        values on the host (sizes from ``seq_lens_cpu``, one gather on the device); ``host``: every
        tensor on the host (capture time); ``host_plan``: the provider re-plans on the host, so
        ``kv_indptr`` / ``kv_last_page_len`` stay there."""
        seq = fb.seq_lens_cpu if getattr(fb, "seq_lens_cpu", None) is not None else fb.seq_lens.cpu()
        seq = seq[:B].to(torch.int64)
        q, custom_mask = (self._verify_q(fb) if mode == "verify" else 1), None
        kv = seq + (q if mode == "verify" else 0)
        ids, rows = self._read_table(fb, B)
        indptr, kv_indices, last = csr_from_req_to_token(ids, rows, kv, self.page_size, check=False)
        if mode == "verify" and getattr(fb.spec_info, "custom_mask", None) is not None:
            numel = int((kv * q).sum())
            custom_mask = fb.spec_info.custom_mask.reshape(-1)[:numel].to(torch.bool)
        qo = torch.arange(B + 1, dtype=torch.int32) * q
        core_mode = CoreMode.DECODE if mode == "decode" else CoreMode.TARGET_VERIFY
        if host:
            kv_indices = kv_indices.cpu()
            custom_mask = None if custom_mask is None else custom_mask.cpu()
        elif not host_plan:  # device CSR: GraphState.update never reads it back
            qo, indptr, last = (t.to(self.device, non_blocking=True) for t in (qo, indptr, last))
        return BatchMetadata(core_mode, qo, indptr, kv_indices, last, custom_mask=custom_mask)

    def _read_table(self, fb, B: int):
        """``(ids [rows, max_ctx], row_ids [B])``: the token-slot table the ``B`` real requests read."""
        table = compat.kv_read_table(
            self.kv_index_translator, fb, self.req_to_token_pool.req_to_token, fb.req_pool_indices[:B]
        )
        if table is None:
            raise self.unsupported("translated (unified / virtual->physical) KV reads")
        return table

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Committed length SGLang gives padded requests of a graph batch: the core's ``FILL_SEQ_LEN``
        (1: one valid KV slot, never an empty row). The core's ``GraphState`` pads with the same value."""
        return FILL_SEQ_LEN

    def _batch_metadata(self, fb):
        """SGLang ``ForwardBatch`` -> core ``BatchMetadata`` (int32 CSR page table over ``req_to_token``)."""
        mode = fb.forward_mode
        bs = int(fb.req_pool_indices.shape[0])
        dev = fb.seq_lens.device
        seq_lens = fb.seq_lens[:bs].to(torch.int32)
        custom_mask = None
        if mode.is_decode():
            spec = getattr(fb, "spec_info", None)
            if spec is not None and getattr(spec, "kv_indptr", None) is not None:
                raise self.unsupported(
                    "EAGLE multi-step draft decode in a single-step backend (SGLang builds "
                    "AttnplugMultiStepDraftBackend through its DraftBackendFactory for it)"
                )
            core_mode, q_lens, kv_lens = CoreMode.DECODE, torch.ones_like(seq_lens), seq_lens
        elif mode.is_target_verify():
            spec = fb.spec_info
            n = spec.num_tokens_per_req if getattr(spec, "num_tokens_per_req", -1) > 0 else spec.draft_token_num
            q_lens, kv_lens = torch.full_like(seq_lens, n), seq_lens + n  # KV = prefix + the n draft tokens
            if getattr(spec, "custom_mask", None) is not None:
                numel = int((q_lens.long() * kv_lens.long()).sum())  # SGLang may pad the mask buffer
                custom_mask = spec.custom_mask.reshape(-1)[:numel].to(torch.bool)
            core_mode = CoreMode.TARGET_VERIFY
        elif mode in self._extend_modes:  # EXTEND, MIXED, DRAFT_EXTEND_V2: seq_lens include the new tokens
            q_lens, kv_lens = fb.extend_seq_lens[:bs].to(torch.int32), seq_lens
            core_mode = CoreMode[self._extend_modes[mode]]
        else:
            raise self.unsupported(f"forward mode {mode.name}")
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        torch.cumsum(q_lens, 0, out=qo_indptr[1:])
        table = compat.kv_read_table(
            self.kv_index_translator, fb, self.req_to_token_pool.req_to_token, fb.req_pool_indices[:bs]
        )
        if table is None:
            raise self.unsupported("translated (unified / virtual->physical) KV reads")
        ids, rows = table
        batch = BatchMetadata.from_req_to_token(
            core_mode, qo_indptr, ids, rows, kv_lens, self.page_size, custom_mask=custom_mask
        )
        return batch, q_lens, kv_lens

    def _plan_forward(self, fb) -> None:
        self._forward_id += 1
        self._graph_fwd = None
        if fb.forward_mode.is_idle():
            self._batch = None
            return
        self._batch, q_lens, kv_lens = self._batch_metadata(fb)
        cascaded = [self._plan(key).current_plan.cascade for key in self._attn]
        st = self._stats
        if cascaded and cascaded[0] is not None:
            st.cascade_forwards += 1
            st.cascade_shared_tokens += cascaded[0].shared_tokens
        st.forwards[fb.forward_mode.name] = st.forwards.get(fb.forward_mode.name, 0) + 1
        if len(kv_lens):
            st.max_kv_len = max(st.max_kv_len, int(kv_lens.max()))
            if fb.forward_mode.is_extend():
                st.max_cached_prefix = max(st.max_cached_prefix, int((kv_lens - q_lens).max()))
        self._write_marker()

    def _plan(self, key: AttentionConfig):
        attn = self.attention(key)
        if self._planned.get(key) != self._forward_id:
            attn.plan(self._batch, num_pages=self.num_pages)
            self._planned[key] = self._forward_id
        return attn

    # -- per layer ------------------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """EXTEND / MIXED / TARGET_VERIFY / DRAFT_EXTEND_V2: ``q [T, Hq*D]`` -> ``[T, Hq*D]``."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """DECODE: ``q [B, Hq*D]`` -> ``[B, Hq*D]``."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _forward(self, q, k, v, layer, fb, save_kv_cache, kwargs):
        sinks = self._check_layer(layer, kwargs)
        if not self._metadata_ready():
            raise RuntimeError(f"attnplug: backend '{self.backend_name}': forward before init_forward_metadata")
        scales = self._scales(layer)
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        run_kw = scales if sinks is None else {**scales, "sinks": self._sink_tensor(sinks)}
        shape = (self.num_pages, self.page_size, self.num_kv_heads, d)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(shape)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id).view(shape)
        if save_kv_cache and k is not None and v is not None:
            # k, v: [T, Hkv, D]; the KV of the new tokens must be in the cache before run().
            self._write_kv(layer, fb, k, v, k_cache, v_cache, scales)
        key = self.layer_config(layer, sinks is not None)
        q3 = q.reshape(-1, hq, d)
        out = torch.empty_like(q3)
        self._run(key, q3, k_cache, v_cache, out, run_kw)
        self._stats.layer_runs += 1
        return out.view(-1, hq * d)

    def _write_kv(self, layer, fb, k, v, k_cache, v_cache, scales: dict) -> None:
        """The new tokens' K/V ``[T, Hkv, D]`` into the pool. bf16 / fp16: SGLang's ``set_kv_buffer``.
        fp8: the core's ``write_kv_capturable`` at ``out_cache_loc`` (the slots ``set_kv_buffer``
        writes) straight into the pool's pages, quantized with saturation by the layer's scales."""
        if not scales:
            self.token_to_kv_pool.set_kv_buffer(layer, compat.write_loc(fb), k, v)
            return
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        write_kv_capturable(
            k.view(-1, hkv, d),
            v.view(-1, hkv, d),
            k_cache,
            v_cache,
            fb.out_cache_loc,
            k_scale=scales["k_scale"],
            v_scale=scales["v_scale"],
        )

    def _scales(self, layer) -> dict:
        """fp8 KV pool: the layer's scale tensors (``layer.k_scale`` / ``v_scale``, SGLang's KV quant
        method), a ones tensor where the layer has none; ``{}`` for an unquantized pool. Plus
        ``host_scales``, the same values as floats, which SGLang fixes at load (``layer.k_scale_float``,
        what its own backends read; 1.0 for a layer without scales)."""
        if self.kv_dtype == self.dtype:
            return {}
        if getattr(self, "_unit_scale", None) is None:
            self._unit_scale = torch.ones(1, dtype=torch.float32, device=self.device)
        k_t, v_t = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
        pick = lambda t: self._unit_scale if t is None else t  # noqa: E731
        sc = dict(k_scale=pick(k_t), v_scale=pick(v_t))
        host = compat.host_kv_scales(layer)
        if host is not None:
            sc["host_scales"] = host
        return sc

    def _sink_tensor(self, sinks: torch.Tensor) -> torch.Tensor:
        """The layer's sinks as the core reads them: the tensor itself where it is float32 or the
        model dtype, else (gpt-oss keeps bf16 sinks in a float32 model) its float32 cast, made on the
        device at each run (so it reads the live values; a CUDA graph captures the cast)."""
        return sinks if sinks.dtype in (torch.float32, self.dtype) else sinks.float()

    def _metadata_ready(self) -> bool:
        """This forward's metadata was built (eagerly or into the graph state)."""
        return self._batch is not None or self._graph_fwd is not None

    def _run(self, key: AttentionConfig, q3, k_cache, v_cache, out, scales: dict | None = None) -> None:
        """One layer's attention: the graph family's plan of ``key`` (:class:`GraphFamily`), else the
        eager plan. ``scales``: fp8 KV, the layer's (:meth:`_scales`); ``sinks`` for a layer with sinks."""
        scales = scales or {}
        if self._graph_fwd is not None:
            mode, bs = self._graph_fwd
            self._graphs[mode].run(key, bs, q3, k_cache, v_cache, out, **scales)
            return
        attn = self._plan(key)
        n = attn.current_plan.num_tokens
        if q3.shape[0] > n:  # q / out_cache_loc padded to a prefill CUDA-graph bucket (breakable graphs)
            out[n:].zero_()
            q3, out = q3[:n], out[:n]
        attn.run(q3, k_cache, v_cache, out=out, **scales)

    # -- proof of life ---------------------------------------------------------------------------------
    def _write_marker(self) -> None:
        st = self._stats
        engine_glue.write_marker(
            "sglang",
            dict(
                backend=self.backend_name,
                provider=self.provider_name,
                page_size=self.page_size,
                layout="NHD",
                dtype=str(self.dtype),
                kv_dtype=str(self.kv_dtype),
                forwards=st.forwards,
                layer_runs=st.layer_runs,
                max_cached_prefix=st.max_cached_prefix,
                max_kv_len=st.max_kv_len,
                cascade_forwards=st.cascade_forwards,
                cascade_shared_tokens=st.cascade_shared_tokens,
                cascade_graph_updates=st.cascade_graph_updates,
                cascade_graph_shared_tokens=st.cascade_graph_shared_tokens,
                triton_interpret=os.environ.get("TRITON_INTERPRET"),
                layer_configs=sorted(f"window {c.window_left}, sinks {c.sinks}" for c in self._attn),
            ),
        )
