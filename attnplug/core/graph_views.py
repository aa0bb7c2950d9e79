"""Typed hand-offs of a graph family (:class:`~attnplug.core.cuda_graph.GraphState`) to its provider's part
(:class:`~attnplug.core.providers.base.ProviderGraph`): the static buffers as one batch size sees them,
and the host twins of a padded batch."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class StaticViews:
    """The static buffers as the plan of a padded batch of ``bs`` requests sees them (views, no copies)."""

    qo_indptr: torch.Tensor  # [bs+1] int32
    kv_indptr: torch.Tensor  # [bs+1] int32
    kv_indices: torch.Tensor  # [capacity] int32: the whole buffer
    kv_last_page_len: torch.Tensor  # [bs] int32
    kv_lens: torch.Tensor  # [bs] int32
    mask: torch.Tensor | None = None  # verify: [capacity] uint8, the whole buffer
    mask_indptr: torch.Tensor | None = None  # verify: [bs+1] int64
    mask_free: torch.Tensor | None = None  # verify: [bs] int32, leading mask-free columns (kv_len - q)

    def plan_fields(self) -> dict[str, torch.Tensor | None]:
        """The views as ``Plan`` keyword arguments (same names)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class HostBatch:
    """Host twins of a padded graph batch of ``bs`` requests (what a host-planning provider re-plans from).
    After a one-launch update from a device page table only the page CSR is there, with ``kv_indices``
    the device buffer's used prefix."""

    kv_indptr: torch.Tensor  # [bs+1] int32
    kv_indices: torch.Tensor  # [nnz] int32
    kv_last_page_len: torch.Tensor  # [bs] int32
    qo_indptr: torch.Tensor | None = None  # [bs+1] int32
    kv_lens: torch.Tensor | None = None  # [bs] int32
    q_lens: torch.Tensor | None = None  # [bs] int32
    mask_indptr: torch.Tensor | None = None  # verify: [bs+1] int64
    mask_free: torch.Tensor | None = None  # verify: [bs] int32
    mask: torch.Tensor | None = None  # verify with a host mask: [sum q * kv_len] uint8


@dataclass
class DeviceTable:
    """The engine's page table of one replay on the device (the update's input; nothing read back).

    ``seq_lens [n]`` KV length a request (this step's ``q`` tokens included; ``<= 0``: a padding row),
    ``block_table [rows, W]`` page ids (``entry_tokens = P``: token slot ids, SGLang's ``req_to_token``),
    ``row_ids [n]`` optional table row a request."""

    seq_lens: torch.Tensor  # [n] int32 / int64
    block_table: torch.Tensor  # [rows, W] int32 / int64, any strides
    row_ids: torch.Tensor | None = None  # [n] int32 / int64
    entry_tokens: int = 1
