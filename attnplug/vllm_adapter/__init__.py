"""vLLM adapter: three attention backends, ``ATTNPLUG_TRITON``, ``ATTNPLUG_FLASHINFER``, ``ATTNPLUG_FA3``,
and their MLA twins for DeepSeek-class models, ``ATTNPLUG_TRITON_MLA`` ... (:mod:`.mla`).

``register()`` is the ``vllm.general_plugins`` entry point; vLLM calls it in every process (front
end, EngineCore, workers). Select a backend with ``--attention-backend attnplug_triton`` (any
case), ``--attention-config '{"backend": "ATTNPLUG_TRITON"}'`` or ``LLM(attention_backend=...)``.
When no attnplug backend is selected nothing in vLLM changes.

Environment (never ``VLLM_*``, vLLM warns about unknown ones):
    ATTNPLUG_MARKER_DIR: when set, each worker writes ``attnplug-<pid>.json`` there (counters
        proving the backend ran; used by the tests).
    ATTNPLUG_PROVIDER_OVERRIDE: debug only, run every attnplug backend on this core provider
        (e.g. ``reference``, the float32 oracle); the active log line names the provider used.
"""

from __future__ import annotations

import logging

from attnplug.engine_glue import BackendTable, engine_missing


#: backend name -> (core provider, backend class path), one per provider the core serves
#: (``ATTNPLUG_TRITON`` -> ``("triton", "attnplug.vllm_adapter.backend.AttnplugTritonBackend")``).
#: The class path is what vLLM imports.
def _gqa_entry(p: str, title: str) -> tuple[str, tuple[str, str]]:
    return f"ATTNPLUG_{p.upper()}", (p, f"{__name__}.backend.Attnplug{title}Backend")


def _mla_entry(p: str, title: str) -> tuple[str, tuple[str, str]]:
    return f"ATTNPLUG_{p.upper()}_MLA", (p, f"{__name__}.mla.Attnplug{title}MLABackend")


BACKENDS = BackendTable(_gqa_entry)
#: the MLA backends (DeepSeek-V2/V3, Kimi K2: vLLM selects MLA backends for them, ``use_mla``):
#: ``ATTNPLUG_TRITON_MLA`` -> ``("triton", "attnplug.vllm_adapter.mla.AttnplugTritonMLABackend")``
MLA_BACKENDS = BackendTable(_mla_entry)
ALL_BACKENDS = BackendTable(_gqa_entry, _mla_entry)  # what register() adds

logger = logging.getLogger("vllm.attnplug")  # child of vLLM's configured "vllm" logger


def register() -> None:
    """Register the attnplug backends with vLLM. Idempotent; never raises; imports nothing heavy
    (no triton, flashinfer or FA3: those load only when a selected backend is built)."""
    if engine_missing("vllm", "vLLM", logger):
        return
    try:
        from . import compat

        compat.route_core_logging()
        compat.register_backends(ALL_BACKENDS)
    except Exception:  # a broken plugin must never stop vLLM from starting
        logger.exception("attnplug: registering the vLLM attention backends failed; they are unavailable")


__all__ = ["ALL_BACKENDS", "BACKENDS", "MLA_BACKENDS", "register"]
