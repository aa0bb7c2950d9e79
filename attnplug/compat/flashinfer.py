"""The flashinfer provider's calls (:data:`attnplug.core.providers.flashinfer.CALLS`) as
:mod:`attnplug.compat.contract` items, to hold them against a FlashInfer release's sources
(``tests/core/test_flashinfer_contract.py``: releases that cannot be imported here)."""

from __future__ import annotations

from attnplug.compat.contract import Item, call


def contract_items() -> list[Item]:
    """One ``call`` item per :class:`~attnplug.core.providers.flashinfer.LibraryCall` of the provider."""
    from attnplug.core.providers.flashinfer import CALLS  # noqa: PLC0415 (loads no library)

    return [call(c.module, c.name, npos=c.npos, kwargs=c.kwargs, required=c.required, why=c.why) for c in CALLS]
