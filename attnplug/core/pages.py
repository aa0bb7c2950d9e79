"""Page arithmetic: the one place that turns token counts into pages and back.

A request of ``n`` tokens on pages of ``P`` tokens owns ``ceil(n / P)`` pages; its last page holds
``n - (pages - 1) * P`` tokens (``1..P``), or 0 for a request with no tokens. Every function takes
Python ints or integer tensors (elementwise, any device) and never reads a device value.
"""

from __future__ import annotations

import torch

__all__ = ["num_pages", "last_page_len", "tokens_from_pages", "indptr_from_counts"]


def num_pages(tokens, page_size: int):
    """``ceil(tokens / page_size)``: pages needed for ``tokens`` tokens (0 for 0)."""
    return (tokens + page_size - 1) // page_size


def last_page_len(tokens, page_size: int):
    """Tokens on the last page of a ``tokens``-token request: ``1..page_size``, or 0 when empty."""
    if isinstance(tokens, torch.Tensor):
        return torch.where(tokens > 0, (tokens - 1) % page_size + 1, torch.zeros_like(tokens))
    return (tokens - 1) % page_size + 1 if tokens > 0 else 0


def tokens_from_pages(pages, last, page_size: int):
    """Inverse of the two above: ``(pages - 1) * page_size + last``, 0 for a request without pages."""
    if isinstance(pages, torch.Tensor):
        return torch.where(pages > 0, (pages - 1) * page_size + last, torch.zeros_like(pages))
    return (pages - 1) * page_size + last if pages > 0 else 0


def indptr_from_counts(counts: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """CSR offsets ``[B+1]`` (``0, c0, c0+c1, ...``) of ``counts [B]``, on ``counts``' device."""
    out = torch.zeros(counts.shape[0] + 1, dtype=dtype, device=counts.device)
    torch.cumsum(counts, 0, dtype=dtype, out=out[1:])
    return out
