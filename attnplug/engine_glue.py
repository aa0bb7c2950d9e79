"""What both engine adapters share: the provider a backend runs, process preparation, proof markers.

Imports nothing heavy (no torch kernels, no triton): the adapters call it from their registration
hooks as well as from their backends.

Environment (never ``VLLM_*`` / ``SGLANG_*``):
    ATTNPLUG_PROVIDER_OVERRIDE: debug only, run every attnplug backend on this core provider (e.g.
        ``reference``, the float32 oracle); the active log line names the provider used.
    ATTNPLUG_MARKER_DIR: when set, each process running an attnplug backend writes
        ``<prefix>-<pid>.json`` there (counters proving the backend ran; used by the tests).
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("attnplug")

PROVIDER_OVERRIDE_ENV = "ATTNPLUG_PROVIDER_OVERRIDE"
MARKER_ENV = "ATTNPLUG_MARKER_DIR"


def provider_for(default: str) -> str:
    """The core provider a backend whose own provider is ``default`` runs (the override wins)."""
    return os.environ.get(PROVIDER_OVERRIDE_ENV) or default


def prepare_process(provider: str, device_type: str) -> None:
    """Let ``provider`` prepare this process (and the ones it spawns) for ``device_type`` before its
    library is imported, e.g. the Triton interpreter on CPU. Never raises: an unknown or broken
    provider fails later, at backend construction, with its own message."""
    try:
        from attnplug.core.providers import get_provider_cls

        get_provider_cls(provider).prepare_process(device_type)
    except Exception as e:  # noqa: BLE001 - a registration hook must never break the engine
        logger.warning("attnplug: preparing provider %r for %s failed (%s)", provider, device_type, e)


def write_marker(prefix: str, data: dict) -> None:
    """Atomically write ``data`` to ``$ATTNPLUG_MARKER_DIR/<prefix>-<pid>.json`` (no-op when unset)."""
    d = os.environ.get(MARKER_ENV)
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{prefix}-{os.getpid()}.json")
    tmp = os.path.join(d, f".{prefix}-{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({**data, "pid": os.getpid()}, f)
    os.replace(tmp, path)
