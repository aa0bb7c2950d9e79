"""SGLang adapter: registers attnplug's attention backends as an SGLang general plugin.

``pyproject.toml`` declares the entry point ``sglang.srt.plugins: attnplug =
attnplug.sglang_adapter:register``. SGLang's ``load_plugins()`` calls :func:`register` in every
process it starts (launcher / ``Engine``, scheduler, detokenizer, DP controller; they are spawned,
so each one registers for itself). Registration only adds three names to SGLang's backend registry
and to the ``--attention-backend`` choices, and (SGLang 0.5.17..0.5.23 only) an AROUND hook on
SGLang's ``DraftBackendFactory._create_backend`` plus the names in the draft-backend choices
(0.5.23; 0.5.17 has no such list), so
that ``--speculative-algorithm EAGLE`` builds attnplug's multi-step draft backend, and the per-model check
hook of :mod:`.model_gates` (gpt-oss: acts only when an attnplug backend is selected); nothing runs, and nothing
heavy (torch kernels, triton,
the attnplug core) is imported until SGLang calls a factory, i.e. until a backend is selected.
"""

from __future__ import annotations

import functools
import logging

from attnplug.engine_glue import BackendTable, engine_missing

logger = logging.getLogger(__name__)

#: SGLang backend name -> attnplug core provider, one per provider the core serves
#: (``attnplug_triton`` -> ``triton``).
BACKENDS = BackendTable(lambda provider, _title: (f"attnplug_{provider}", provider))

#: Names added to ``--speculative-draft-attention-backend`` choices, only when the
#: ``DraftBackendFactory`` hook is installed (SGLang in ``compat.DRAFT_HOOK_VERSIONS``): every backend.
DRAFT_BACKENDS = BACKENDS
# Not added to SGLang's deterministic list: batch invariance of the providers is not established.
DETERMINISTIC_BACKENDS: tuple[str, ...] = ()


def _factory(name: str, model_runner):
    """SGLang backend factory: ``model_runner -> AttentionBackend`` (imports the backend lazily).

    Raises:
        RuntimeError: this SGLang is outside the tested range and its interface changed
            (``compat.engine_refusal``), naming attnplug, both versions and what changed.
    """
    from . import compat

    refusal = compat.engine_refusal()
    if refusal:
        raise RuntimeError(f"{refusal} (selected: {name})")
    if compat.is_mla_model(model_runner):  # DeepSeek-V2/V3, Kimi K2: absorbed MLA over the latent pool
        from .mla import AttnplugMLAAttnBackend

        return AttnplugMLAAttnBackend(model_runner, backend_name=name)
    from .backend import AttnplugAttnBackend

    return AttnplugAttnBackend(model_runner, backend_name=name)


def _make_draft_backend(factory, name: str, multi_step: bool):
    """An attnplug EAGLE draft backend on SGLang's draft runner: the multi-step container (draft
    decode) or an :class:`~.draft.AttnplugDraftExtendBackend` (draft extend, captured in CUDA graphs)."""
    from . import compat

    runner = factory.draft_model_runner
    if multi_step:
        from .draft import AttnplugMultiStepDraftBackend

        return AttnplugMultiStepDraftBackend(runner, factory.topk, factory.speculative_num_steps, backend_name=name)
    from attnplug.core import resolve_provider

    from .draft import AttnplugDraftExtendBackend

    if not resolve_provider(BACKENDS[name])[1].graph_support.chain_verify:
        from .backend import AttnplugAttnBackend  # SGLang's capture check fails for it: draft extend eager

        return AttnplugAttnBackend(runner, backend_name=name)
    compat.declare_draft_extend_graphs(AttnplugDraftExtendBackend)
    return AttnplugDraftExtendBackend(runner, backend_name=name)


def _around_create_backend(orig, factory, backend_name, backend_map, error_template, *args, **kwargs):
    """AROUND hook of SGLang's ``DraftBackendFactory._create_backend`` (EAGLE draft backends).

    Adds the ``attnplug_*`` names to a copy of SGLang's ``backend_map`` (lazy factories): the
    multi-step draft container when SGLang builds the draft *decode* backend
    (``create_decode_backend``; the draft extend call may also pass
    ``backend_name="decode_attention_backend"`` when ``speculative_attention_mode == "decode"``, so
    the name does not tell), else a plain :class:`AttnplugAttnBackend` on the draft runner (draft
    extend). How SGLang marks the decode call and what a map entry returns differ between releases:
    ``compat.draft_call_is_decode`` / ``compat.draft_map_entry``. Built-in names are untouched:
    SGLang's own entries are passed through as they are, and the selection, error and stamping stay
    SGLang's.
    """
    from . import compat

    multi_step = compat.draft_call_is_decode(orig, error_template, args, kwargs)
    ours = dict(backend_map)
    for name in BACKENDS:
        if name not in ours:
            ours[name] = compat.draft_map_entry(
                orig, name, functools.partial(_make_draft_backend, factory, name, multi_step), multi_step
            )
    return orig(factory, backend_name, ours, error_template, *args, **kwargs)


def _prepare_selected_providers(result, server_args, *args, **kwargs):
    """AFTER-hook of ``ServerArgs`` resolution, in the launcher before the scheduler is spawned: the
    providers of the selected attnplug backends prepare the processes SGLang spawns for
    ``--device`` (the triton provider turns the Triton interpreter on for CPU; triton cannot switch
    it on once imported). Does nothing when no attnplug backend is selected."""
    from attnplug import engine_glue

    try:
        names = {
            getattr(server_args, f, None)
            for f in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
        }
        device = str(getattr(server_args, "device", "") or "cuda")
        for name in names & set(BACKENDS):
            engine_glue.prepare_process(BACKENDS[name], device)  # the override applies
    except Exception as e:  # noqa: BLE001 - never break argument resolution
        logger.warning("attnplug: could not prepare the selected attnplug providers (%s)", e)
    return None  # keep SGLang's result


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group. Never raises."""
    if engine_missing("sglang", "SGLang", logger):
        return
    try:
        from . import compat, model_gates

        refusal = compat.engine_refusal()
        if refusal:  # the names stay selectable; choosing one raises this message (_factory)
            logger.error("%s", refusal)
        for name in BACKENDS:
            compat.register_attention_backend(name, functools.partial(_factory, name))
        compat.add_attention_backend_choices(list(BACKENDS))
        compat.after_server_args_resolved(_prepare_selected_providers)
        model_gates.install()  # gpt-oss: SGLang's own backend list, its hybrid SWA pool
        # EAGLE: SGLang has no draft-backend registry; hook its private factory (version-guarded).
        if compat.install_draft_backend_hook(_around_create_backend):
            compat.add_draft_attention_backend_choices(list(DRAFT_BACKENDS))
        else:
            logger.info("%s", compat.draft_hook_refusal())
    except Exception as e:  # noqa: BLE001 - a plugin must never break SGLang
        logger.warning(
            "attnplug: SGLang plugin registration failed (%s: %s); attnplug backends unavailable", type(e).__name__, e
        )


__all__ = ["BACKENDS", "register"]
