"""vLLM adapter: three attention backends, ``ATTNPLUG_TRITON``, ``ATTNPLUG_FLASHINFER``, ``ATTNPLUG_FA3``.

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
BACKENDS = BackendTable(lambda p, title: (f"ATTNPLUG_{p.upper()}", (p, f"{__name__}.backend.Attnplug{title}Backend")))

logger = logging.getLogger("vllm.attnplug")  # child of vLLM's configured "vllm" logger


def register() -> None:
    """Register the attnplug backends with vLLM. Idempotent; never raises; imports nothing heavy
    (no triton, flashinfer or FA3: those load only when a selected backend is built)."""
    if engine_missing("vllm", "vLLM", logger):
        return
    try:
        from . import compat

        compat.route_core_logging()
        compat.register_backends(BACKENDS)
    except Exception:  # a broken plugin must never stop vLLM from starting
        logger.exception("attnplug: registering the vLLM attention backends failed; they are unavailable")


__all__ = ["BACKENDS", "register"]
