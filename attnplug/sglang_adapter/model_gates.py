"""SGLang's per-model backend checks, for models whose attention attnplug's core computes.

SGLang checks some architectures against a fixed list of built-in backends while it resolves its
``ServerArgs`` (``handle_model_specific_adjustments``: ``compat.model_step_target``, a private
``ServerArgs`` method in 0.5.17). For gpt-oss the list is the backends
that compute attention sinks and per-layer sliding windows: ``GptOssForCausalLM requires one of
['triton', 'trtllm_mha', 'fa3', ...]``. attnplug's providers compute both (each refuses at startup
what it cannot, by name), so when an ``attnplug_*`` backend is selected for a model in
:data:`GATED_MODELS`:

* the check sees each selected attnplug name as the built-in backend named there (SGLang's
  reference for that model's attention): an AROUND hook on the step swaps SGLang's
  ``(prefill, decode)`` backend resolver, which that step calls only in the per-model branches,
  for the duration of the step and for that model only;
* the model's KV lives in one plain pool (``disable_hybrid_swa_memory``, declared through SGLang's
  model-override registry): attnplug reads ``MHATokenToKVPool`` only, each layer's window is
  applied in attention (``sliding_window_size`` per layer), not by a second, smaller pool.

With no attnplug backend selected both do nothing: the step runs as it is and the override
declares nothing. :func:`install` never raises.
"""

from __future__ import annotations

import logging

from . import compat

logger = logging.getLogger(__name__)

#: architecture -> the built-in backend its SGLang check is shown in place of an attnplug name
GATED_MODELS = {"GptOssForCausalLM": "triton"}

_INSTALLED: set[str] = set()


def selected_attnplug_backends(server_args) -> set[str]:
    """The ``attnplug_*`` names among the attention backends given to SGLang (base, prefill, decode)."""
    from . import BACKENDS

    fields = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    return {getattr(server_args, f, None) for f in fields} & set(BACKENDS)


def model_arch(server_args) -> str | None:
    """The model's first architecture (the one SGLang's checks key on); ``None`` where it has none."""
    try:
        from sglang.srt.arg_groups.overrides import model_config_of  # 0.5.23: memoized on the record
    except ImportError:
        model_config_of = type(server_args).get_model_config  # 0.5.17: cached on the ServerArgs
    try:
        return model_config_of(server_args).hf_config.architectures[0]
    except Exception:  # noqa: BLE001 - no HF config (instance connector): SGLang's step decides alone
        return None


def around_model_step(step, server_args, *args, **kwargs):
    """AROUND hook of SGLang's model step: runs it as it is unless an attnplug backend is selected
    for a model in :data:`GATED_MODELS`; then the step's backend resolver reports each attnplug name
    as the model's reference backend while the step runs."""
    names = selected_attnplug_backends(server_args)
    arch = model_arch(server_args) if names else None
    reference = GATED_MODELS.get(arch)
    if reference is None:
        return step(server_args, *args, **kwargs)
    owner, attr = compat.model_step_resolver(server_args)
    raw = owner.__dict__.get(attr)
    if raw is None:  # the resolver moved: SGLang's own check decides (and refuses with its message)
        logger.warning(
            "attnplug: SGLang's backend resolver %s.%s is gone; %s keeps SGLang's own backend list",
            getattr(owner, "__name__", owner),
            attr,
            arch,
        )
        return step(server_args, *args, **kwargs)

    def resolved(*a, **k):
        return tuple(reference if n in names else n for n in raw(*a, **k))

    logger.info(
        "attnplug: %s's attention-backend check admits %s (attention sinks and per-layer sliding "
        "windows computed by attnplug's core, checked as SGLang's %r)",
        arch,
        ", ".join(sorted(names)),
        reference,
    )
    setattr(owner, attr, resolved)
    try:
        return step(server_args, *args, **kwargs)
    finally:
        setattr(owner, attr, raw)


def plain_kv_pool_override(server_args, hf_config) -> dict:
    """SGLang model-override provider (``(server_args, hf_config) -> {field: value}``) of the gated
    models: ``disable_hybrid_swa_memory`` when an attnplug backend is selected, else nothing."""
    names = selected_attnplug_backends(server_args)  # only the user names attnplug: the raw fields
    if not names or getattr(server_args, "disable_hybrid_swa_memory", False):
        return {}
    logger.info(
        "attnplug: %s keeps its KV in one plain pool with %s (hybrid SWA memory disabled; each "
        "layer's window is applied in attention)",
        hf_config.architectures[0],
        ", ".join(sorted(names)),
    )
    return {"disable_hybrid_swa_memory": True}


def install() -> bool:
    """Register :func:`around_model_step` on SGLang's model step and :func:`plain_kv_pool_override` for
    each of :data:`GATED_MODELS` (once per process; ``load_plugins`` applies the hook after our
    ``register``). Returns False, changing nothing, where the release has neither step; never raises."""
    try:
        from sglang.srt.arg_groups.overrides import register_model_override
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        target = compat.model_step_target()
        if target is None:
            logger.info(
                "attnplug: this SGLang has no model-specific step to hook; gated models (%s) keep "
                "SGLang's own backend lists",
                ", ".join(GATED_MODELS),
            )
            return False
        if target not in _INSTALLED:
            HookRegistry.register(target, around_model_step, HookType.AROUND)
            for arch in GATED_MODELS:
                register_model_override(arch)(plain_kv_pool_override)
            _INSTALLED.add(target)
        return True
    except Exception as e:  # noqa: BLE001 - a plugin must never break SGLang
        logger.warning(
            "attnplug: could not hook SGLang's per-model backend checks (%s: %s); %s keep SGLang's own backend lists",
            type(e).__name__,
            e,
            ", ".join(GATED_MODELS),
        )
        return False
