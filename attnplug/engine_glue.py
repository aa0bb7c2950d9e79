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

import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping

logger = logging.getLogger("attnplug")

PROVIDER_OVERRIDE_ENV = "ATTNPLUG_PROVIDER_OVERRIDE"  # the core registry's (``registry.selected_provider``)
MARKER_ENV = "ATTNPLUG_MARKER_DIR"


def engine_missing(module: str, engine: str, log: logging.Logger) -> bool:
    """True, after one log line saying so, when ``engine``'s package ``module`` is not installed here:
    the adapters' ``register()`` then has nothing to register (no version check, no traceback)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed install: not importable either
        found = False
    if not found:
        log.warning(
            "attnplug: %s is not installed in this environment (no module %r): the attnplug %s "
            "backends are not registered",
            engine,
            module,
            engine,
        )
    return not found


class BackendTable(Mapping):
    """An adapter's table of backends: engine backend name -> value, one entry per provider the core's
    registry serves and per ``entry(provider, title) -> (name, value)`` given (e.g. a GQA and an MLA
    backend per provider), read at each use, so a provider registered later (one file + one registry
    line) is listed without an adapter edit."""

    def __init__(self, *entries: Callable[[str, str], tuple[str, object]]):
        self._entries = entries

    def _table(self) -> dict:
        from attnplug.core.registry import served_providers  # noqa: PLC0415 - light, but not at load

        return dict(e(name, title) for e in self._entries for name, title in served_providers().items())

    def __getitem__(self, name: str):
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"BackendTable({self._table()!r})"


def provider_for(default: str) -> str:
    """The core provider a backend whose own provider is ``default`` runs (the override wins)."""
    from attnplug.core.registry import selected_provider  # noqa: PLC0415 - light, but not at load

    return selected_provider(default)


def prepare_process(provider: str, device_type: str) -> None:
    """Let the provider of a backend whose own provider is ``provider`` (the override applies) prepare this
    process (and the ones it spawns) for ``device_type`` before its library is imported, e.g. the Triton
    interpreter on CPU; for the adapters' registration hooks (a backend calls its resolved class's
    ``prepare_process``). Never raises: an unknown or broken provider fails later, at backend
    construction, with its own message."""
    try:
        from attnplug.core.registry import resolve_provider  # noqa: PLC0415 - light, but not at load

        resolve_provider(provider)[1].prepare_process(device_type)
    except Exception as e:  # noqa: BLE001 - a registration hook must never break the engine
        logger.warning("attnplug: preparing provider %r for %s failed (%s)", provider, device_type, e)


def markers_on() -> bool:
    """Whether this process writes proof markers (``$ATTNPLUG_MARKER_DIR`` set)."""
    return bool(os.environ.get(MARKER_ENV))


class LateCounts:
    """Device counters (``[k]`` int64 tensors, e.g. ``CascadeGraph.counts``) read for the proof
    markers without a host sync: :meth:`read` queues a copy into pinned host memory behind the work
    queued so far and returns the newest copies that have landed, summed over every tensor read so
    far (several graph families: a drafter's and the target's), so a marker lags the device by a step
    or so. CPU tensors are read at once."""

    def __init__(self) -> None:
        self._slots: dict[int, list] = {}  # id(counts) -> [counts, host copy, event or None, last values]

    def read(self, counts) -> list[int]:
        slot = self._slots.get(id(counts))
        if slot is None:
            slot = self._slots[id(counts)] = [counts, None, None, [0] * counts.numel()]
        if counts.device.type == "cpu":
            slot[3] = [int(x) for x in counts.tolist()]
        else:
            import torch  # noqa: PLC0415 - this module imports no torch at load

            if slot[1] is None:
                slot[1] = torch.zeros(counts.shape, dtype=counts.dtype, pin_memory=True)
            if slot[2] is not None and slot[2].query():  # the previous copy has landed
                slot[3], slot[2] = [int(x) for x in slot[1].tolist()], None
            if slot[2] is None:
                slot[1].copy_(counts, non_blocking=True)
                slot[2] = torch.cuda.Event()
                slot[2].record()
        return [sum(v) for v in zip(*(s[3] for s in self._slots.values()))]


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
