"""Version glue: every place the SGLang API differs between releases, in one module.

Supported: SGLang 0.5.23 (CPU CI here) and 0.5.17 (the GPU image). Known differences (notes §8):

* ``ATTENTION_BACKEND_CHOICES`` / ``add_attention_backend_choices`` live in
  ``sglang.srt.arg_groups.choices`` (0.5.23) vs ``sglang.srt.server_args`` (0.5.17); 0.5.23 still
  re-exports them from ``server_args``, so we try ``arg_groups.choices`` first.
* attention-TP size: ``sglang.srt.runtime_context.get_parallel().attn_tp_size`` (0.5.23) vs
  ``sglang.srt.layers.dp_attention.get_attention_tp_size()`` (0.5.17).
* ``KVWriteLoc`` (0.5.23 write locations) may be missing in older releases: a bare tensor is then
  passed to ``set_kv_buffer``.

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


def after_server_args_resolved(hook) -> None:
    """Run ``hook(result, server_args)`` after SGLang resolves its ``ServerArgs`` (once per process).

    0.5.23 resolves in ``ServerArgs.resolve_once``; 0.5.17 in ``ServerArgs.__post_init__``. Uses
    SGLang's plugin ``HookRegistry`` (applied by ``load_plugins`` right after our ``register``).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ServerArgs

    method = "resolve_once" if hasattr(ServerArgs, "resolve_once") else "__post_init__"
    target = f"sglang.srt.server_args.ServerArgs.{method}"
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


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"
