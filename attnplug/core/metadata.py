"""Unified forward metadata: one description of a batch for every forward mode.

A batch holds ``B`` requests. Request ``b`` owns ``kv_len[b]`` tokens of KV in the paged cache
(its cached prefix *and* the new tokens of this forward, already written to the cache) and
``q_len[b] = qo_indptr[b+1] - qo_indptr[b]`` new query tokens, which sit at the end of its KV:
query ``i`` of request ``b`` has absolute position ``kv_len[b] - q_len[b] + i`` (causal masks are
aligned bottom-right, as in FlashInfer's paged prefill).

Page tables use FlashInfer's CSR naming: the pages of request ``b`` are
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and its last page holds ``kv_last_page_len[b]`` tokens,
so ``kv_len[b] = (num_pages[b] - 1) * page_size + kv_last_page_len[b]`` (0 when it owns no page).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class ForwardMode(str, Enum):
    """What a forward computes. All modes share one kernel contract; they differ in masks/shapes."""

    EXTEND = "extend"  # new tokens after a (possibly empty) cached prefix, causal
    PREFILL = "extend"  # alias: a prefill is an extend with an empty prefix
    DECODE = "decode"  # exactly one new token per request
    TARGET_VERIFY = "target_verify"  # speculative verify: draft tokens + custom (tree) mask
    DRAFT_EXTEND = "draft_extend"  # draft model extend after verification, causal
    MIXED = "mixed"  # extends and decodes in one batch, causal


@dataclass
class BatchMetadata:
    """Engine-neutral description of one forward batch (host or device int32 tensors).

    Attributes:
        mode: the forward mode.
        qo_indptr: ``[B+1]`` int32, CSR offsets of each request's new query tokens in ``q``.
        kv_indptr: ``[B+1]`` int32, CSR offsets into ``kv_indices``.
        kv_indices: ``[nnz_pages]`` int32, page ids (index along dim 0 of the KV cache).
        kv_last_page_len: ``[B]`` int32, tokens in each request's last page (1..page_size, or 0
            for a request without pages).
        custom_mask: optional ``[sum_b q_len[b] * kv_len[b]]`` bool; request ``b``'s block is a
            row-major ``[q_len[b], kv_len[b]]`` matrix, True = may attend (FlashInfer semantics).
            Required for TARGET_VERIFY with a tree; when given, ``causal`` is ignored.
        causal: causal (bottom-right) masking when no custom mask is given.
    """

    mode: ForwardMode
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    custom_mask: torch.Tensor | None = None
    causal: bool = True

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.numel()) - 1

    @classmethod
    def _check_args(cls, mode, qo_indptr, batch_size: int, custom_mask, causal) -> None:
        """What the classmethods can check before building (``make_plan`` checks the values):
        ``ValueError`` naming the argument."""
        if not isinstance(mode, ForwardMode):
            raise ValueError(f"mode must be a ForwardMode, got {mode!r}")
        if not isinstance(qo_indptr, torch.Tensor) or qo_indptr.dtype != torch.int32 or qo_indptr.dim() != 1:
            got = (
                f"{qo_indptr.dtype} shape {list(qo_indptr.shape)}"
                if isinstance(qo_indptr, torch.Tensor)
                else type(qo_indptr).__name__
            )
            raise ValueError(f"qo_indptr must be a 1-D torch.int32 tensor, got {got}")
        if qo_indptr.shape[0] != batch_size + 1:
            raise ValueError(f"qo_indptr must have B+1 = {batch_size + 1} elements, got {qo_indptr.shape[0]}")
        if custom_mask is not None and (
            not isinstance(custom_mask, torch.Tensor)
            or custom_mask.dim() != 1
            or custom_mask.dtype not in (torch.bool, torch.uint8)
        ):
            raise ValueError("custom_mask must be None or a 1-D torch.bool (or uint8) tensor")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")

    @classmethod
    def from_block_table(
        cls,
        mode: ForwardMode,
        qo_indptr: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        custom_mask: torch.Tensor | None = None,
        causal: bool = True,
    ) -> BatchMetadata:
        """Build from the block-table dialect (vLLM / FA3): ``block_table [B, max_pages]``, ``seq_lens [B]``.

        Raises:
            ValueError: naming the argument (the converter's checks, then ``mode``, ``qo_indptr``'s
                type and length, ``custom_mask``'s type, ``causal``); ``make_plan`` checks the values.
        """
        from .page_table import csr_from_block_table

        kv_indptr, kv_indices, last = csr_from_block_table(block_table, seq_lens, page_size)
        cls._check_args(mode, qo_indptr, last.shape[0], custom_mask, causal)
        return cls(mode, qo_indptr, kv_indptr, kv_indices, last, custom_mask, causal)

    @classmethod
    def from_req_to_token(
        cls,
        mode: ForwardMode,
        qo_indptr: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        custom_mask: torch.Tensor | None = None,
        causal: bool = True,
    ) -> BatchMetadata:
        """Build from SGLang's token-level ``req_to_token [slots, max_ctx]`` dialect.

        Raises:
            ValueError: as :meth:`from_block_table`.
        """
        from .page_table import csr_from_req_to_token

        kv_indptr, kv_indices, last = csr_from_req_to_token(req_to_token, req_pool_indices, seq_lens, page_size)
        cls._check_args(mode, qo_indptr, last.shape[0], custom_mask, causal)
        return cls(mode, qo_indptr, kv_indptr, kv_indices, last, custom_mask, causal)
