"""Version glue: every place the SGLang API differs between releases, in one module.

Supported: SGLang 0.5.23 (CPU CI here) and 0.5.17 (the GPU image). Known differences (notes §8):

* ``ATTENTION_BACKEND_CHOICES`` / ``add_attention_backend_choices`` live in
  ``sglang.srt.arg_groups.choices`` (0.5.23) vs ``sglang.srt.server_args`` (0.5.17); 0.5.23 still
  re-exports them from ``server_args``, so we try ``arg_groups.choices`` first.
* attention-TP size: ``sglang.srt.runtime_context.get_parallel().attn_tp_size`` (0.5.23) vs
  ``sglang.srt.layers.dp_attention.get_attention_tp_size()`` (0.5.17).
* ``KVWriteLoc`` (0.5.23 write locations) may be missing in older releases: a bare tensor is then
  passed to ``set_kv_buffer``. 0.5.17 has it, without ``for_batch`` / ``physical``.
* ``KVIndexTranslator`` / ``ModelRunner.kv_index_translator`` (0.5.23) does not exist in 0.5.17:
  reads go straight through ``req_to_token`` (:func:`kv_read_table`); 0.5.17's unified pool is a
  subclass of ``MHATokenToKVPool`` and refused by the backend's exact pool-type check.
* ``ServerArgs`` resolution: ``resolve_once`` (0.5.23) vs ``__post_init__`` (0.5.17)
  (:func:`server_args_resolution_target`).
* The per-model backend step (``model_gates``): ``model_hook.handle_model_specific_adjustments`` and
  its resolver ``attention_backends_of`` (0.5.23) vs the private ``ServerArgs._handle_model_specific_adjustments``
  / ``ServerArgs._resolved_attention_backends`` (0.5.17) (:func:`model_step_target`, :func:`model_step_resolver`).
* ``DRAFT_ATTENTION_BACKEND_CHOICES`` exists in 0.5.23 only (0.5.17's EAGLE path has no draft-name
  gate).
* ``DraftBackendFactory._create_backend``: 0.5.23 ``(backend_name, backend_map, error_template,
  stamps_children=False)``, map entries return ``(stamp, backend)`` and SGLang stamps the
  ``*_attention_backend_str`` names; 0.5.17 ``(backend_name, backend_map, error_template)``, entries
  return the backend, nothing stamped (:func:`draft_call_is_decode`, :func:`draft_map_entry`).
* ``generate_draft_decode_kv_indices`` gained ``window_size`` / ``sink_size`` (draft window) after
  0.5.17; the draft KV layout (:func:`draft_token_columns`) is the same in both.
* Unchanged and relied on (read in both wheels): the ``AttentionBackend`` graph contract
  (``init_cuda_graph_state(max_bs, max_num_tokens)``, ``init_forward_metadata_out_graph(fb,
  in_capture=False)``, ``init_forward_metadata_in_graph(fb)``, ``get_cuda_graph_seq_len_fill_value()``;
  the legacy ``*_capture_cuda_graph`` / ``*_replay_cuda_graph`` are gone from both), the decode
  graph runner's replay view (``build_replay_fb_view``: padded ``batch_size``, ``num_padding``,
  ``seq_lens_cpu``), the EAGLE draft graph runner (container ``init_cuda_graph_state``,
  ``attn_backends[0].get_cuda_graph_seq_len_fill_value()``, padded batch without ``num_padding``),
  the plugin loader and ``HookRegistry``, ``runtime_context.get_parallel``.

* EAGLE draft backends: SGLang has no draft registry; attnplug hooks the private
  ``DraftBackendFactory._create_backend`` (AROUND, through SGLang's ``HookRegistry``) and relies on
  the draft KV layout of ``generate_draft_decode_kv_indices`` (:func:`draft_token_columns`), both
  checked for :data:`DRAFT_HOOK_VERSIONS` only; outside that range the hook is not installed and an
  attnplug backend on the draft model refuses with :func:`draft_hook_refusal`'s message.

Everything here imports SGLang lazily, inside functions.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_CHOICE_MODULES = ("sglang.srt.arg_groups.choices", "sglang.srt.server_args")


def _choices_module() -> ModuleType:
    """The module that owns ``ATTENTION_BACKEND_CHOICES`` in the installed SGLang."""
    err: Exception | None = None
    for name in _CHOICE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            err = e
            continue
        if hasattr(mod, "ATTENTION_BACKEND_CHOICES"):
            return mod
    raise ImportError(f"attnplug: no SGLang module among {_CHOICE_MODULES} has ATTENTION_BACKEND_CHOICES ({err})")


def attention_backend_choices() -> list[str]:
    """SGLang's ``--attention-backend`` choices list (the live object argparse uses)."""
    return _choices_module().ATTENTION_BACKEND_CHOICES


def add_attention_backend_choices(names: list[str]) -> None:
    """Add ``names`` (not yet present) to the choices of ``--attention-backend`` and friends."""
    mod = _choices_module()
    new = [n for n in names if n not in mod.ATTENTION_BACKEND_CHOICES]
    if not new:
        return
    add = getattr(mod, "add_attention_backend_choices", None)
    if add is not None:
        add(new)
    else:  # releases without the helper: the list itself is what argparse holds
        mod.ATTENTION_BACKEND_CHOICES.extend(new)


def register_attention_backend(name: str, factory) -> bool:
    """Put ``factory(model_runner) -> AttentionBackend`` into SGLang's registry under ``name``.

    Returns False (and changes nothing) when ``name`` is already registered.
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if name in ATTENTION_BACKENDS:
        return False
    register_attention_backend(name)(factory)
    return True


_HOOKED: set[str] = set()


def server_args_resolution_target() -> str:
    """Where SGLang resolves its ``ServerArgs``: ``ServerArgs.resolve_once`` (0.5.23) or
    ``ServerArgs.__post_init__`` (0.5.17), as a ``HookRegistry`` target."""
    from sglang.srt.server_args import ServerArgs

    method = "resolve_once" if hasattr(ServerArgs, "resolve_once") else "__post_init__"
    return f"sglang.srt.server_args.ServerArgs.{method}"


def after_server_args_resolved(hook) -> None:
    """Run ``hook(result, server_args)`` after SGLang resolves its ``ServerArgs`` (once per process).

    Target: :func:`server_args_resolution_target`. Uses SGLang's plugin ``HookRegistry`` (applied by
    ``load_plugins`` right after our ``register``).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = server_args_resolution_target()
    if target not in _HOOKED:
        HookRegistry.register(target, hook, HookType.AFTER)
        _HOOKED.add(target)


def attn_tp_size() -> int:
    """Attention tensor-parallel size of this process (heads are split by it)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_size)
    except (ImportError, AttributeError):
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        return int(get_attention_tp_size())


def attn_dcp_size() -> int:
    """Decode-context-parallel size (1 where the release has no DCP)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except (ImportError, AttributeError):
        return 1


def write_loc(forward_batch):
    """The write location ``set_kv_buffer`` takes for this batch's new tokens (``out_cache_loc [T]``)."""
    try:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    except ImportError:  # releases before KVWriteLoc take the bare tensor
        return forward_batch.out_cache_loc
    if hasattr(KVWriteLoc, "for_batch"):
        return KVWriteLoc.for_batch(forward_batch)
    return KVWriteLoc(forward_batch.out_cache_loc)


def host_kv_scales(layer) -> tuple[float, float] | None:
    """``(k, v)``: the fp8 KV scales SGLang's own backends read as floats (``layer.k_scale_float``,
    set once when the checkpoint's scales load), ``(1.0, 1.0)`` for a layer without scales, ``None``
    where a scale tensor has no float (the tensors then stay the only source)."""
    k_t, v_t = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
    k_f, v_f = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    if k_t is None and v_t is None and k_f is None and v_f is None:
        return 1.0, 1.0
    if isinstance(k_f, float) and isinstance(v_f, float) and k_t is not None and v_t is not None:
        return k_f, v_f
    return None


def kv_read_table(translator, forward_batch, req_to_token, req_pool_indices):
    """``(ids [rows, max_ctx], row_ids [B])``: the token-slot table this batch's KV is read from.

    Through SGLang's ``KVIndexTranslator`` when the release has one (0.5.23): on a plain pool it
    hands back ``req_to_token`` / ``req_pool_indices`` themselves. Returns ``None`` when the reads
    would need a virtual->physical translation (unified pools), which the caller refuses.
    """
    if translator is None or not hasattr(translator, "read_source"):
        return req_to_token, req_pool_indices
    bs = int(req_pool_indices.shape[0])
    src = translator.read_source(getattr(forward_batch, "kv_loc_plan", None), req_pool_indices=req_pool_indices, bs=bs)
    if src.v2p is not None or src.entry_page_size != 1:
        return None
    return src.ids, src.row_ids[:bs]


def sglang_forward_mode():
    """SGLang's ``ForwardMode`` enum."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode


def extend_like_modes() -> dict:
    """SGLang modes computed as "new tokens after a cached prefix" -> name of the core mode.

    0.5.23 has ``DRAFT_EXTEND_V2`` only; older releases also ``DRAFT_EXTEND``.
    """
    M = sglang_forward_mode()
    modes = {M.EXTEND: "EXTEND", M.MIXED: "MIXED"}
    for name in ("DRAFT_EXTEND_V2", "DRAFT_EXTEND"):
        if hasattr(M, name):
            modes[getattr(M, name)] = "DRAFT_EXTEND"
    return modes


def plain_mha_pool_cls():
    """The plain (non-hybrid, non-MLA) token-to-KV pool class."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool


def mla_pool_cls():
    """The plain MLA latent pool class (``[slots, 1, kv_lora_rank + rope]`` per layer)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool


def is_mla_model(model_runner) -> bool:
    """The model's attention is MLA (SGLang builds an MLA pool and calls ``attn_mqa`` for it)."""
    arch = getattr(getattr(model_runner, "model_config", None), "attention_arch", None)
    return getattr(arch, "name", "") == "MLA"


def register_mla_dispatch(name: str, mha_prefill: bool) -> bool:
    """Register backend ``name``'s choice in SGLang's DeepSeek attention dispatch (0.5.17..0.5.23:
    ``AttentionBackendRegistry`` of ``deepseek_common.attention_backend_handler``; unknown names get the
    triton default's MHA prefill). ``mha_prefill=False``: absorbed MLA in every mode
    (``_dispatch_mla_subtype``: its MLA method, or its AMX variant on such CPUs). ``True``: SGLang's ``fa3``
    choice (``handle_attention_fa3``) where that choice is one pass of MHA over the up-projected K / V
    (``MHA_ONE_SHOT``; ``MHA_CHUNKED_KV`` of a batch without a cached prefix, which is one pass too), and
    absorbed MLA otherwise (chunked-prefix MHA merges prefix chunks by LSE outside the backend, a path
    attnplug does not run). ``False`` where this SGLang has no such registry."""
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            AttentionBackendRegistry,
            _dispatch_mla_subtype,
        )

        handler = _one_pass_mha_handler(_dispatch_mla_subtype) if mha_prefill else _dispatch_mla_subtype
    except ImportError:
        return False
    AttentionBackendRegistry.register(name, handler)
    return True


def _one_pass_mha_handler(absorbed):
    """SGLang's ``fa3`` choice where it is one MHA pass, else ``absorbed`` (see :func:`register_mla_dispatch`)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import handle_attention_fa3
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod as M

    def handle(attn, forward_batch):
        method = handle_attention_fa3(attn, forward_batch)
        if method == M.MHA_ONE_SHOT:
            return method
        if method == M.MHA_CHUNKED_KV and not any(forward_batch.extend_prefix_lens_cpu or ()):
            return method
        return absorbed(attn, forward_batch)

    return handle


def versions_info() -> str:
    """``attnplug X, SGLang Y`` for the "active" log line."""
    import attnplug

    return f"attnplug {attnplug.__version__}, SGLang {sglang_version()}"


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


# -- per-model backend checks (model_gates.py): a private ServerArgs step in 0.5.17 ----------------
#: SGLang's per-model step as a ``HookRegistry`` target: 0.5.23's ``model_hook`` function, 0.5.17's
#: private ``ServerArgs`` method.
MODEL_STEP_023 = "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments"
MODEL_STEP_017 = "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments"


def model_step_target() -> str | None:
    """The ``HookRegistry`` target of SGLang's per-model step in this release; ``None``: it has none."""
    try:
        from sglang.srt.arg_groups.model_hook import handle_model_specific_adjustments  # noqa: F401
    except ImportError:
        from sglang.srt.server_args import ServerArgs

        return MODEL_STEP_017 if hasattr(ServerArgs, MODEL_STEP_017.rsplit(".", 1)[1]) else None
    return MODEL_STEP_023


def model_step_resolver(server_args) -> tuple[object, str]:
    """``(owner, attribute)`` of the ``(prefill, decode)`` backend resolver SGLang's model step calls:
    ``model_hook.attention_backends_of`` (0.5.23) or ``ServerArgs._resolved_attention_backends``
    (0.5.17)."""
    try:
        from sglang.srt.arg_groups import model_hook
    except ImportError:
        return type(server_args), "_resolved_attention_backends"
    return model_hook, "attention_backends_of"


# -- EAGLE multi-step draft: SGLang's private DraftBackendFactory -----------------------------------
#: SGLang releases whose ``DraftBackendFactory._create_backend(backend_name, backend_map,
#: error_template, stamps_children)`` and draft KV layout (``generate_draft_decode_kv_indices``)
#: attnplug's draft hook was written against (inclusive). Both are private API.
DRAFT_HOOK_VERSIONS = ("0.5.17", "0.5.23")
DRAFT_FACTORY_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"


def _version_tuple(v: str) -> tuple:
    """``"0.5.23"`` -> ``(0, 5, 23)`` (``attnplug.compat.contract.version_tuple``)."""
    from attnplug.compat.contract import version_tuple

    return version_tuple(v)


def draft_hook_refusal(version: str | None = None) -> str | None:
    """``None`` when the installed SGLang is in :data:`DRAFT_HOOK_VERSIONS`, else the reason (a
    complete, user-facing message)."""
    from attnplug.compat.contract import in_range

    v = sglang_version() if version is None else version
    lo, hi = DRAFT_HOOK_VERSIONS
    if in_range(v, lo, hi):
        return None
    return (
        f"attnplug: EAGLE speculative decoding with an attnplug_* attention backend needs SGLang "
        f"{lo}..{hi} (attnplug hooks SGLang's private DraftBackendFactory, whose API it checked only "
        f"in that range); installed SGLang is {v}. Use a supported SGLang, or pick a built-in draft "
        f"backend: --speculative-draft-attention-backend triton"
    )


def install_draft_backend_hook(around) -> bool:
    """Register ``around(orig, factory, backend_name, backend_map, error_template, stamps_children=False)``
    as an AROUND hook of ``DraftBackendFactory._create_backend`` (once per process; ``load_plugins``
    applies it right after our ``register``). Returns False, changing nothing, outside
    :data:`DRAFT_HOOK_VERSIONS`."""
    if draft_hook_refusal() is not None:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if DRAFT_FACTORY_TARGET not in _HOOKED:
        HookRegistry.register(DRAFT_FACTORY_TARGET, around, HookType.AROUND)
        _HOOKED.add(DRAFT_FACTORY_TARGET)
    return True


def draft_hook_installed() -> bool:
    return DRAFT_FACTORY_TARGET in _HOOKED


def draft_attention_backend_choices() -> list[str] | None:
    """SGLang's ``DRAFT_ATTENTION_BACKEND_CHOICES`` (0.5.23), ``None`` where the release has none (0.5.17)."""
    return getattr(_choices_module(), "DRAFT_ATTENTION_BACKEND_CHOICES", None)


def add_draft_attention_backend_choices(names: list[str]) -> None:
    """Add ``names`` to ``DRAFT_ATTENTION_BACKEND_CHOICES`` (``--speculative-draft-attention-backend``);
    nothing to do where the release has no such list."""
    mod = _choices_module()
    lst = getattr(mod, "DRAFT_ATTENTION_BACKEND_CHOICES", None)
    if lst is None:
        return
    new = [n for n in names if n not in lst]
    if new:
        add = getattr(mod, "add_draft_attention_backend_choices", None)
        (add or lst.extend)(new)


def draft_factory_stamps(orig) -> bool:
    """True for the 0.5.23 ``_create_backend`` protocol (a ``stamps_children`` parameter; map entries
    return ``(stamp, backend)``; SGLang stamps the names), False for 0.5.17's (entries return the
    backend). ``orig``: the function the AROUND hook wraps (``inspect`` follows ``__wrapped__``)."""
    import inspect

    try:
        return "stamps_children" in inspect.signature(orig).parameters
    except (TypeError, ValueError):
        return False


def draft_call_is_decode(orig, error_template: str, args: tuple, kwargs: dict) -> bool:
    """Whether this ``_create_backend`` call builds the multi-step draft *decode* backend.

    0.5.23: ``create_decode_backend`` is the only caller passing ``stamps_children=True``. 0.5.17 has
    no such flag and ``backend_name`` does not tell (draft extend passes ``decode_attention_backend``
    too under ``speculative_attention_mode == "decode"``); its decode call is the one whose error
    template reads "EAGLE is not supported in decode attention backend {backend_type}" (extend:
    "... in attention backend ...").
    """
    if draft_factory_stamps(orig):
        return bool(kwargs.get("stamps_children", args[0] if args else False))
    return "decode attention backend" in error_template


def draft_map_entry(orig, name: str, build, multi_step: bool):
    """A ``backend_map`` entry for ``name`` in the installed release's form: ``() -> (name, backend)``
    (0.5.23, SGLang stamps) or ``() -> backend`` stamped here like 0.5.23 does (0.5.17)."""
    if draft_factory_stamps(orig):
        return lambda: (name, build())

    def make():
        backend = build()
        for b in [backend] + (list(backend.attn_backends) if multi_step else []):
            b.prefill_attention_backend_str = b.decode_attention_backend_str = name
        return backend

    return make


def draft_token_columns(seq_lens, topk: int, num_steps: int, page_size: int, steps_used: int):
    """Columns of ``req_to_token`` holding the draft tokens: ``[B, topk, steps_used]`` int64 (host).

    SGLang's EAGLE layout (``generate_draft_decode_kv_indices``, 0.5.17..0.5.23): branch ``j`` of
    request ``b`` writes its ``num_steps`` draft tokens after the prefix, at ``seq_len + j*num_steps
    + t`` when ``page_size == 1 or topk == 1``; otherwise every branch starts a page run of its own:
    ``seq_len//P*P + j*ceil((seq_len%P + num_steps)/P)*P + seq_len%P + t``.
    """
    import torch as _t

    s = seq_lens.long().cpu()[:, None, None]
    j = _t.arange(topk)[None, :, None]
    t = _t.arange(steps_used)[None, None, :]
    P = page_size
    if P == 1 or topk == 1:
        return s + j * num_steps + t
    last = s % P
    per_topk = (last + num_steps + P - 1) // P
    return s // P * P + j * per_topk * P + last + t


def draft_decode_window(model_runner) -> tuple[int, int]:
    """``(window, sink)`` SGLang applies to the draft decode KV (``(0, 0)``: full attention).

    Through SGLang's ``resolve_draft_decode_window`` when present; a runner without ``server_args``
    (or a release without the option) has no draft window.
    """
    if getattr(model_runner, "server_args", None) is None:
        return 0, 0
    try:
        from sglang.srt.speculative.spec_utils import resolve_draft_decode_window
    except ImportError:
        return 0, 0
    w, s = resolve_draft_decode_window(model_runner)
    return int(w), int(s)


# -- the interface contract (tests/sglang/test_contract_sglang.py checks it against each release's
# sources; at registration it is checked on releases outside TESTED_SGLANG) ---------------------------
#: SGLang releases attnplug was run against (inclusive): 0.5.17 (H200, CPU), 0.5.23 (CPU CI; the newest).
TESTED_SGLANG = ("0.5.17", "0.5.23")
_BASE = "sglang.srt.layers.attention.base_attn_backend"
_CHOICES = _CHOICE_MODULES
_OURS = "attnplug.sglang_adapter.backend:AttnplugAttnBackend."
_DRAFT = "attnplug.sglang_adapter.draft:AttnplugMultiStepDraftBackend."


def _contract():
    from attnplug.compat.contract import attr, call, const, override

    opt = {"required": False}
    pool, fbi = "sglang.srt.mem_cache.memory_pool", "sglang.srt.model_executor.forward_batch_info"
    return (
        # plugin loading, registry, CLI choices, hooks
        const("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP", "sglang.srt.plugins"),
        attr("sglang.srt.layers.attention.attention_registry", "ATTENTION_BACKENDS"),
        call("sglang.srt.layers.attention.attention_registry", "register_attention_backend", npos=1),
        attr(_CHOICES, "ATTENTION_BACKEND_CHOICES"),
        attr(_CHOICES, "add_attention_backend_choices", **opt),
        call("sglang.srt.plugins.hook_registry", "HookRegistry.register", npos=3, lead=("target", "hook", "hook_type")),
        attr("sglang.srt.plugins.hook_registry", "HookType.AFTER"),
        attr("sglang.srt.plugins.hook_registry", "HookType.AROUND"),
        attr("sglang.srt.server_args", "ServerArgs.resolve_once|__post_init__"),
        # the AttentionBackend contract (CUDA-graph API included)
        call(_BASE, "AttentionBackend", npos=0, why="super().__init__()"),
        *(
            override(_BASE, f"AttentionBackend.{m}", _OURS + m)
            for m in (
                "init_forward_metadata",
                "init_forward_metadata_out_graph",
                "init_forward_metadata_in_graph",
                "init_cuda_graph_state",
                "get_cuda_graph_seq_len_fill_value",
                "forward_extend",
                "forward_decode",
            )
        ),
        # what the backend reads from the model runner, the pools, the batch and the layer
        *(
            attr("sglang.srt.model_executor.model_runner", f"ModelRunner.{a}")
            for a in ("device", "dtype", "req_to_token_pool", "token_to_kv_pool", "model_config")
        ),
        attr("sglang.srt.model_executor.model_runner", "ModelRunner.page_size", **opt),
        attr("sglang.srt.model_executor.model_runner", "ModelRunner.kv_index_translator", **opt),
        call(pool, "MHATokenToKVPool.set_kv_buffer", npos=4),
        call(pool, "MHATokenToKVPool.get_key_buffer", npos=1),
        call(pool, "MHATokenToKVPool.get_value_buffer", npos=1),
        *(attr(pool, f"MHATokenToKVPool.{a}") for a in ("head_num", "head_dim", "dtype")),
        # MLA models (mla.py): the latent pool and DeepSeek's per-backend attention dispatch
        call(pool, "MLATokenToKVPool.set_kv_buffer", npos=4),
        call(pool, "MLATokenToKVPool.get_key_buffer", npos=1),
        *(attr(pool, f"MLATokenToKVPool.{a}") for a in ("kv_lora_rank", "qk_rope_head_dim", "dtype")),
        call(
            "sglang.srt.models.deepseek_common.attention_backend_handler",
            "AttentionBackendRegistry.register",
            npos=2,
            lead=("backend_name", "handler_func"),
            why="MLA models only (refused without it)",
            **opt,
        ),
        attr(
            "sglang.srt.models.deepseek_common.attention_backend_handler",
            "_dispatch_mla_subtype",
            why="MLA models only (refused without it)",
            **opt,
        ),
        call(pool, "KVWriteLoc.for_batch", npos=1, **opt),
        *(attr(fbi, f"ForwardMode.{m}") for m in ("EXTEND", "DECODE", "MIXED", "TARGET_VERIFY", "IDLE")),
        *(
            attr(fbi, f"ForwardBatch.{f}")
            for f in (
                "forward_mode",
                "batch_size",
                "seq_lens",
                "seq_lens_cpu",
                "req_pool_indices",
                "out_cache_loc",
                "extend_seq_lens",
                "spec_info",
            )
        ),
        *(
            attr("sglang.srt.layers.radix_attention", f"RadixAttention.{a}")
            for a in (
                "layer_id",
                "tp_q_head_num",
                "tp_k_head_num",
                "qk_head_dim",
                "v_head_dim",
                "scaling",
                "logit_cap",
                "sliding_window_size",
                "is_cross_attention",
                "attn_type",
            )
        ),
        call("sglang.srt.runtime_context", "get_parallel", npos=0, **opt),
    )


def _draft_contract():
    """EAGLE draft path (hooked only for SGLang in :data:`DRAFT_HOOK_VERSIONS`)."""
    from attnplug.compat.contract import attr, call, callsite

    runner = "sglang.srt.speculative.eagle_draft_cuda_graph_runner"
    return (
        call(
            "sglang.srt.speculative.draft_utils",
            "DraftBackendFactory._create_backend",
            npos=3,
            lead=("backend_name", "backend_map", "error_template"),
        ),
        *(
            attr("sglang.srt.speculative.draft_utils", f"DraftBackendFactory.{a}")
            for a in ("draft_model_runner", "topk", "speculative_num_steps")
        ),
        *(
            callsite(runner, m, _DRAFT + m, recv="draft_attn_backend")
            for m in ("init_cuda_graph_state", "init_forward_metadata_in_graph", "init_forward_metadata_out_graph")
        ),
        callsite(
            "sglang.srt.speculative.eagle_worker_v2",
            "init_forward_metadata",
            _DRAFT + "init_forward_metadata",
            recv="draft_attn_backend",
        ),
        # draft extend in CUDA graphs: SGLang's capture check admits FlashInferAttnBackend (declare_draft_extend_graphs)
        attr("sglang.srt.layers.attention.flashinfer_backend", "FlashInferAttnBackend"),
        *(
            callsite(
                "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
                m,
                _OURS + m,
                recv="draft_extend_attn_backend",
            )
            for m in ("init_cuda_graph_state", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph")
        ),
    )


_REFUSAL: dict[str, str | None] = {}


def engine_refusal(version: str | None = None, engine_root: str | None = None) -> str | None:
    """``None`` when attnplug can serve this SGLang, else the reason (complete, user-facing): outside
    :data:`TESTED_SGLANG` the installed sources are checked against :data:`CONTRACT` (``ast``, nothing
    imported); anything gone or changed refuses (``attnplug.compat.contract.refusal``)."""
    import logging

    from attnplug.compat import contract as _contract

    v = sglang_version() if version is None else version
    key = f"{v}@{engine_root}"
    if key not in _REFUSAL:
        _REFUSAL[key] = _contract.refusal(
            "SGLang", "sglang", v, TESTED_SGLANG, CONTRACT, logging.getLogger(__name__), engine_root
        )
    return _REFUSAL[key]


CONTRACT = _contract()
DRAFT_CONTRACT = _draft_contract()


def declare_draft_extend_graphs(cls) -> bool:
    """Make SGLang capture EAGLE draft extend with attnplug's draft-extend backend ``cls``: SGLang's
    EAGLE worker (``EAGLEWorkerV2._capture_cuda_graphs``, 0.5.17 and 0.5.23) captures it only when the
    backend ``isinstance`` one of the types it lists, ``FlashInferAttnBackend`` among them; ``cls`` is
    registered as a virtual subclass of that ABC (``ABCMeta.register``: no behaviour inherited, only the
    check answered, for this one class, which captures DRAFT_EXTEND for every provider). ``False`` where
    SGLang has no such class (draft extend then runs eagerly)."""
    try:
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    except Exception:  # noqa: BLE001 - a build without it: SGLang's check fails, draft extend stays eager
        return False
    if not issubclass(cls, FlashInferAttnBackend):
        FlashInferAttnBackend.register(cls)
    return True
