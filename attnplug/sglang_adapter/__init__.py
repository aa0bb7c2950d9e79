"""SGLang adapter: registers attnplug's attention backends as an SGLang general plugin.

``pyproject.toml`` declares the entry point ``sglang.srt.plugins: attnplug =
attnplug.sglang_adapter:register``. SGLang's ``load_plugins()`` calls :func:`register` in every
process it starts (launcher / ``Engine``, scheduler, detokenizer, DP controller; they are spawned,
so each one registers for itself). Registration only adds three names to SGLang's backend registry
and to the ``--attention-backend`` choices; nothing runs, and nothing heavy (torch kernels, triton,
the attnplug core) is imported until SGLang calls a factory, i.e. until a backend is selected.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

#: SGLang backend name -> attnplug core provider.
BACKENDS: dict[str, str] = {
    "attnplug_triton": "triton",
    "attnplug_flashinfer": "flashinfer",
    "attnplug_fa3": "fa3",
}

# Not added to SGLang's draft / deterministic lists yet: EAGLE multi-step draft is issue 6, and
# batch invariance of the providers is not established (SGLang's deterministic mode needs it).
DRAFT_BACKENDS: tuple[str, ...] = ()
DETERMINISTIC_BACKENDS: tuple[str, ...] = ()


def _factory(name: str, model_runner):
    """SGLang backend factory: ``model_runner -> AttentionBackend`` (imports the backend lazily)."""
    from .backend import AttnplugAttnBackend

    return AttnplugAttnBackend(model_runner, backend_name=name)


def _enable_triton_interpreter_on_cpu(result, server_args, *args, **kwargs):
    """AFTER-hook of ``ServerArgs`` resolution, in the launcher before the scheduler is spawned.

    On ``--device cpu`` with ``attnplug_triton`` selected, set ``TRITON_INTERPRET=1`` so that the
    spawned scheduler imports triton with the interpreter on (it cannot be switched on once triton
    is imported). Does nothing otherwise, or when the user set ``TRITON_INTERPRET`` themselves.
    """
    try:
        names = {getattr(server_args, f, None) for f in
                 ("attention_backend", "prefill_attention_backend", "decode_attention_backend")}
        if ("attnplug_triton" in names and str(getattr(server_args, "device", "")) == "cpu"
                and "TRITON_INTERPRET" not in os.environ):
            os.environ["TRITON_INTERPRET"] = "1"
            logger.info("attnplug: attnplug_triton on --device cpu: TRITON_INTERPRET=1 for the SGLang processes")
    except Exception as e:  # noqa: BLE001 - never break argument resolution
        logger.warning("attnplug: could not check for the Triton interpreter (%s)", e)
    return None  # keep SGLang's result


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group. Never raises."""
    try:
        from . import compat

        for name in BACKENDS:
            compat.register_attention_backend(name, functools.partial(_factory, name))
        compat.add_attention_backend_choices(list(BACKENDS))
        compat.after_server_args_resolved(_enable_triton_interpreter_on_cpu)
    except Exception as e:  # noqa: BLE001 - a plugin must never break SGLang
        logger.warning("attnplug: SGLang plugin registration failed (%s: %s); attnplug backends unavailable",
                       type(e).__name__, e)


__all__ = ["BACKENDS", "register"]
