"""Exact converters between the three paged-KV page-table dialects.

Dialects (all tensors int32, any device; ``P`` = page size, ``B`` = batch size):

* **CSR** (FlashInfer): ``kv_indptr [B+1]``, ``kv_indices [nnz_pages]``, ``kv_last_page_len [B]``.
  Request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; its last page holds
  ``kv_last_page_len[b]`` tokens (``1..P``; ``0`` iff the request has no pages / no tokens).
* **Block table** (FA3 / vLLM): ``block_table [B, max_pages]`` (padding arbitrary), ``seq_lens [B]``.
* **Token table** (SGLang): ``req_to_token [num_req_slots, max_ctx]`` of token slot ids
  (``slot = page * P + offset``), ``req_pool_indices [B]``, ``seq_lens [B]``. With ``P > 1`` the
  slots of a request must be page aligned: token ``t`` lives at ``page_of(t) * P + t % P``.

Token ``t`` of a request lives at slot ``page[t // P] * P + t % P`` in every dialect.
All converters are loop-free torch ops. Validation (``check=True``) syncs with the device; pass
``check=False`` on hot paths once the producer is trusted.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "csr_from_block_table",
    "block_table_from_csr",
    "csr_from_req_to_token",
    "req_to_token_from_csr",
    "seq_lens_from_csr",
    "slot_mapping",
    "slot_mapping_from_csr",
]

_I32 = torch.int32
_INDEX_DTYPES = (torch.int32, torch.int64)


_I32_MAX = 2**31 - 1
MAX_PAGE_SIZE = 1 << 20  # far above any engine's; keeps every token count of an int32 table in int64 range


def _check_page_size(page_size: int) -> None:
    if (
        isinstance(page_size, bool)
        or not isinstance(page_size, (int, np.integer))
        or not 1 <= page_size <= MAX_PAGE_SIZE
    ):
        raise ValueError(f"page_size must be an int in 1..{MAX_PAGE_SIZE}, got {page_size!r}")


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] = (_I32,)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    if t.device.type == "meta":
        raise ValueError(f"{name} must be on a real device (cpu or an accelerator), got {t.device}")
    return t


def _check_same_device(name: str, t: torch.Tensor, other: str, ref: torch.Tensor, host_ok: bool = False) -> None:
    """``t`` must be on ``ref``'s device (or on the host, where ``host_ok``)."""
    if t.device != ref.device and not (host_ok and t.device.type == "cpu"):
        where = f"the host or {ref.device}" if host_ok else str(ref.device)
        raise ValueError(f"{name} must be on {where} (the device of {other}), got {t.device}")


def _check_count(name: str, value: object, lo: int, hi: int = _I32_MAX) -> int:
    """An int argument in ``lo..hi`` (numpy ints accepted, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return int(value)


def _check_total_pages(name: str, num_pages: torch.Tensor) -> None:
    """The page count of a whole batch must index an int32 array."""
    if num_pages.numel() and int(num_pages.sum()) > _I32_MAX:
        raise ValueError(f"{name}: the batch needs {int(num_pages.sum())} pages, more than int32 page tables hold")


def _check_len(name: str, t: torch.Tensor, n: int, what: str) -> None:
    if t.shape[0] != n:
        raise ValueError(f"{name} must have length {n} ({what}), got {t.shape[0]}")


def _check_nonneg(name: str, t: torch.Tensor) -> None:
    if t.numel() and bool((t < 0).any()):
        raise ValueError(f"{name} must be >= 0, got min {int(t.min())}")


def _ceil_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages per request, int64 (no int32 overflow next to 2**31 tokens)."""
    return (seq_lens.long() + page_size - 1) // page_size


def _last_page_len(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return torch.where(seq_lens > 0, (seq_lens - 1) % page_size + 1, torch.zeros_like(seq_lens))


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.shape[0] + 1, dtype=_I32, device=counts.device)
    out[1:] = torch.cumsum(counts, 0)  # callers checked the total fits int32
    return out


def _check_csr(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor | None, kv_last_page_len: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Validate a CSR page table; returns ``num_pages [B]`` int32."""
    _check_page_size(page_size)
    _check_tensor("kv_indptr", kv_indptr, 1)
    _check_tensor("kv_last_page_len", kv_last_page_len, 1)
    if kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr must have length B+1 >= 1, got 0")
    batch = kv_indptr.shape[0] - 1
    _check_len("kv_last_page_len", kv_last_page_len, batch, "B = len(kv_indptr) - 1")
    _check_same_device("kv_last_page_len", kv_last_page_len, "kv_indptr", kv_indptr)
    if int(kv_indptr[0]) != 0:
        raise ValueError(f"kv_indptr[0] must be 0, got {int(kv_indptr[0])}")
    num_pages = kv_indptr[1:].long() - kv_indptr[:-1].long()  # int64: int32 differences can wrap
    _check_nonneg("kv_indptr differences (pages per request)", num_pages)
    if num_pages.numel() and int(num_pages.max()) * page_size > _I32_MAX:
        raise ValueError(
            f"kv_indptr: a request of {int(num_pages.max())} pages of {page_size} tokens exceeds int32 token counts"
        )
    if kv_indices is not None:
        _check_tensor("kv_indices", kv_indices, 1)
        _check_same_device("kv_indices", kv_indices, "kv_indptr", kv_indptr)
        if int(kv_indptr[-1]) != kv_indices.shape[0]:
            raise ValueError(
                f"kv_indptr[-1] must equal len(kv_indices) = {kv_indices.shape[0]}, got {int(kv_indptr[-1])}"
            )
        _check_nonneg("kv_indices", kv_indices)
    has = num_pages > 0
    ok = torch.where(has, (kv_last_page_len >= 1) & (kv_last_page_len <= page_size), kv_last_page_len == 0)
    if not bool(ok.all()):
        b = int((~ok).nonzero()[0, 0])
        raise ValueError(
            f"kv_last_page_len[{b}] must be in 1..{page_size} (or 0 for a request with 0 pages), "
            f"got {int(kv_last_page_len[b])} with {int(num_pages[b])} pages"
        )
    return num_pages.to(_I32)


def seq_lens_from_csr(
    kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int, *, check: bool = True
) -> torch.Tensor:
    """Token count per request. Returns ``seq_lens [B]`` int32."""
    num_pages = _check_csr(kv_indptr, None, kv_last_page_len, page_size) if check else kv_indptr[1:] - kv_indptr[:-1]
    return torch.where(num_pages > 0, (num_pages - 1) * page_size + kv_last_page_len, 0).to(_I32)


def csr_from_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table -> CSR.

    Args:
        block_table: ``[B, max_pages]`` int32; entries past ``ceil(seq_lens[b] / P)`` are ignored.
        seq_lens: ``[B]`` int32 tokens per request.
        page_size: ``P``.

    Returns:
        ``kv_indptr [B+1]``, ``kv_indices [nnz_pages]``, ``kv_last_page_len [B]``, all int32.
    """
    if check:
        _check_page_size(page_size)
        _check_tensor("block_table", block_table, 2)
        _check_tensor("seq_lens", seq_lens, 1)
        _check_len("seq_lens", seq_lens, block_table.shape[0], "B = block_table.shape[0]")
        _check_same_device("seq_lens", seq_lens, "block_table", block_table)
        _check_nonneg("seq_lens", seq_lens)
    num_pages = _ceil_pages(seq_lens, page_size)
    if check and num_pages.numel() and int(num_pages.max()) > block_table.shape[1]:
        raise ValueError(
            f"seq_lens need up to {int(num_pages.max())} pages but block_table has max_pages={block_table.shape[1]}"
        )
    if check:
        _check_total_pages("seq_lens", num_pages)
    mask = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < num_pages[:, None]
    kv_indices = block_table[mask].to(_I32)
    if check:
        _check_nonneg("block_table (used entries)", kv_indices)
    return _indptr(num_pages), kv_indices, _last_page_len(seq_lens, page_size).to(_I32)


def block_table_from_csr(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    max_pages: int | None = None,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR -> block table.

    Returns:
        ``block_table [B, max_pages]`` int32 (padding 0; ``max_pages`` defaults to the largest
        page count), ``seq_lens [B]`` int32.
    """
    if check:
        _check_tensor("kv_indices", kv_indices, 1)
    num_pages = (
        _check_csr(kv_indptr, kv_indices, kv_last_page_len, page_size) if check else kv_indptr[1:] - kv_indptr[:-1]
    )
    need = int(num_pages.max()) if num_pages.numel() else 0
    if max_pages is None:
        max_pages = need
    else:
        max_pages = _check_count("max_pages", max_pages, 0)
        if max_pages < need:
            raise ValueError(f"max_pages must be >= {need} (largest page count), got {max_pages}")
    batch = num_pages.shape[0]
    block_table = torch.zeros(batch, max_pages, dtype=_I32, device=kv_indptr.device)
    mask = torch.arange(max_pages, device=kv_indptr.device)[None, :] < num_pages[:, None]
    block_table[mask] = kv_indices.to(_I32)
    return block_table, seq_lens_from_csr(kv_indptr, kv_last_page_len, page_size, check=False)


def csr_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang token table -> CSR.

    Args:
        req_to_token: ``[num_req_slots, max_ctx]`` int32 token slot ids.
        req_pool_indices: ``[B]`` int32/int64 row of each request in ``req_to_token``.
        seq_lens: ``[B]`` int32/int64 tokens per request.

    Returns:
        ``kv_indptr [B+1]``, ``kv_indices [nnz_pages]``, ``kv_last_page_len [B]``, all int32;
        ``kv_indptr`` / ``kv_last_page_len`` on ``seq_lens``' device, ``kv_indices`` on the table's.
        With host ``seq_lens`` and ``check=False`` nothing is read back from the table's device
        (CUDA-graph replays: sizes from the engine's host lengths, one gather on the device).

    Raises:
        ValueError: slots are negative or not page aligned (token ``t`` not at ``page * P + t % P``
            with one page shared by all tokens of a page).
    """
    if check:
        _check_page_size(page_size)
        _check_tensor("req_to_token", req_to_token, 2)
        _check_tensor("req_pool_indices", req_pool_indices, 1, _INDEX_DTYPES)
        _check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES)
        _check_len("seq_lens", seq_lens, req_pool_indices.shape[0], "B = len(req_pool_indices)")
        _check_same_device("req_pool_indices", req_pool_indices, "req_to_token", req_to_token, host_ok=True)
        _check_same_device("seq_lens", seq_lens, "req_to_token", req_to_token, host_ok=True)
        _check_nonneg("seq_lens", seq_lens)
        _check_nonneg("req_pool_indices", req_pool_indices)
        if req_pool_indices.numel() and int(req_pool_indices.max()) >= req_to_token.shape[0]:
            raise ValueError(
                f"req_pool_indices must be < num_req_slots = {req_to_token.shape[0]}, got {int(req_pool_indices.max())}"
            )
        if seq_lens.numel() and int(seq_lens.max()) > req_to_token.shape[1]:
            raise ValueError(f"seq_lens must be <= max_ctx = {req_to_token.shape[1]}, got {int(seq_lens.max())}")
        _check_total_pages("seq_lens", _ceil_pages(seq_lens, page_size))
    dev = req_to_token.device
    seq_lens = seq_lens.to(_I32)
    if check:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        rows = req_to_token[req_pool_indices.long().to(dev), :max_len]  # [B, max_len]
        pos = torch.arange(max_len, device=dev)
        valid = pos[None, :] < seq_lens[:, None]
        slots = rows[valid]
        _check_nonneg("req_to_token (used slots)", slots)
        head = rows[:, (pos // page_size) * page_size]  # slot of the first token of each token's page
        aligned = (rows - pos % page_size == head) & (head % page_size == 0)
        if not bool(aligned[valid].all()):
            b, t = (~aligned & valid).nonzero()[0].tolist()
            raise ValueError(
                f"req_to_token row {int(req_pool_indices[b])} is not page aligned for page_size={page_size}: "
                f"token {t} has slot {int(rows[b, t])}, expected page * {page_size} + {t % page_size} with the "
                f"page of token {(t // page_size) * page_size}"
            )
    # index arrays on seq_lens' device (host lengths: no device read), one gather on the table's device
    num_pages = _ceil_pages(seq_lens, page_size)
    indptr = _indptr(num_pages)
    nnz = int(indptr[-1])
    req = torch.repeat_interleave(torch.arange(num_pages.shape[0], device=num_pages.device), num_pages, output_size=nnz)
    col = (torch.arange(nnz, device=num_pages.device) - indptr[:-1].long()[req]) * page_size
    nb = dict(non_blocking=True)
    row = req_pool_indices.to(dev, **nb).long()[req.to(dev, **nb)]
    kv_indices = (req_to_token[row, col.to(dev, **nb)].long() // page_size).to(_I32)
    return indptr, kv_indices, _last_page_len(seq_lens, page_size).to(_I32)


def req_to_token_from_csr(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    num_req_slots: int | None = None,
    max_ctx: int | None = None,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR -> SGLang token table, request ``b`` in row ``b``.

    Returns:
        ``req_to_token [num_req_slots, max_ctx]`` int32 (padding 0; defaults: ``B`` rows, longest
        sequence columns), ``req_pool_indices [B]`` int32 (``arange(B)``), ``seq_lens [B]`` int32.
    """
    if check:
        _check_tensor("kv_indices", kv_indices, 1)
        _check_csr(kv_indptr, kv_indices, kv_last_page_len, page_size)
    seq_lens = seq_lens_from_csr(kv_indptr, kv_last_page_len, page_size, check=False)
    batch = seq_lens.shape[0]
    need = int(seq_lens.max()) if batch else 0
    max_ctx = need if max_ctx is None else _check_count("max_ctx", max_ctx, 0)
    num_req_slots = batch if num_req_slots is None else _check_count("num_req_slots", num_req_slots, 0)
    if max_ctx < need:
        raise ValueError(f"max_ctx must be >= {need} (longest sequence), got {max_ctx}")
    if num_req_slots < batch:
        raise ValueError(f"num_req_slots must be >= {batch} (batch size), got {num_req_slots}")
    dev = kv_indptr.device
    bt, _ = block_table_from_csr(
        kv_indptr, kv_indices, kv_last_page_len, page_size, -(-max_ctx // page_size), check=False
    )
    pos = torch.arange(max_ctx, device=dev)
    slots = bt[:, pos // page_size] * page_size + (pos % page_size).to(_I32)
    req_to_token = torch.zeros(num_req_slots, max_ctx, dtype=_I32, device=dev)
    req_to_token[:batch] = torch.where(pos[None, :] < seq_lens[:, None], slots, 0).to(_I32)
    return req_to_token, torch.arange(batch, dtype=_I32, device=dev), seq_lens


def slot_mapping(
    block_table: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor, page_size: int, *, check: bool = True
) -> torch.Tensor:
    """Slot id of each token: ``block_table[req, pos // P] * P + pos % P``.

    Args:
        block_table: ``[B, max_pages]`` int32.
        positions: ``[T]`` int32/int64 token positions within their request.
        req_ids: ``[T]`` int32/int64 row of ``block_table`` for each token.

    Returns:
        ``[T]`` int32 slot ids.
    """
    if check:
        _check_page_size(page_size)
        _check_tensor("block_table", block_table, 2)
        _check_tensor("positions", positions, 1, _INDEX_DTYPES)
        _check_tensor("req_ids", req_ids, 1, _INDEX_DTYPES)
        _check_len("req_ids", req_ids, positions.shape[0], "T = len(positions)")
        _check_same_device("positions", positions, "block_table", block_table)
        _check_same_device("req_ids", req_ids, "block_table", block_table)
        _check_nonneg("positions", positions)
        _check_nonneg("req_ids", req_ids)
        if req_ids.numel() and int(req_ids.max()) >= block_table.shape[0]:
            raise ValueError(f"req_ids must be < B = {block_table.shape[0]}, got {int(req_ids.max())}")
        if positions.numel() and int(positions.max()) // page_size >= block_table.shape[1]:
            raise ValueError(
                f"positions must be < max_pages * page_size = {block_table.shape[1] * page_size}, "
                f"got {int(positions.max())}"
            )
    pos = positions.long()
    pages = block_table[req_ids.long(), pos // page_size].long()
    if check:
        _check_nonneg("block_table (used entries)", pages)
    return (pages * page_size + pos % page_size).to(_I32)


def slot_mapping_from_csr(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    page_size: int,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Slot id of each token from a CSR page table (``kv_indices[kv_indptr[req] + pos // P] * P + pos % P``).

    Args:
        kv_indptr: ``[B+1]`` int32; kv_indices: ``[nnz_pages]`` int32.
        req_ids, positions: ``[T]`` int32/int64.

    Returns:
        ``[T]`` int32 slot ids.
    """
    pos = positions.long() if isinstance(positions, torch.Tensor) else positions
    if check:
        _check_page_size(page_size)
        _check_tensor("kv_indptr", kv_indptr, 1)
        _check_tensor("kv_indices", kv_indices, 1)
        _check_tensor("positions", positions, 1, _INDEX_DTYPES)
        _check_tensor("req_ids", req_ids, 1, _INDEX_DTYPES)
        _check_len("req_ids", req_ids, positions.shape[0], "T = len(positions)")
        for name, t in (("kv_indices", kv_indices), ("positions", positions), ("req_ids", req_ids)):
            _check_same_device(name, t, "kv_indptr", kv_indptr)
        _check_nonneg("positions", positions)
        _check_nonneg("req_ids", req_ids)
        if kv_indptr.shape[0] < 1 or int(kv_indptr[0]) != 0:
            raise ValueError(f"kv_indptr must start with 0 (length B+1 >= 1), got {kv_indptr[:1].tolist()}")
        _check_nonneg("kv_indptr differences (pages per request)", kv_indptr[1:].long() - kv_indptr[:-1].long())
        if int(kv_indptr[-1]) != kv_indices.shape[0]:
            raise ValueError(
                f"kv_indptr[-1] must equal len(kv_indices) = {kv_indices.shape[0]}, got {int(kv_indptr[-1])}"
            )
        if req_ids.numel() and int(req_ids.max()) >= kv_indptr.shape[0] - 1:
            raise ValueError(f"req_ids must be < B = {kv_indptr.shape[0] - 1}, got {int(req_ids.max())}")
    rid = req_ids.long()
    start = kv_indptr.long()[rid]
    if check:
        n = kv_indptr.long()[rid + 1] - start
        bad = pos // page_size >= n
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"positions[{i}] = {int(pos[i])} must be < pages of request {int(rid[i])} * page_size "
                f"= {int(n[i]) * page_size}"
            )
    pages = kv_indices[start + pos // page_size].long()
    if check:
        _check_nonneg("kv_indices (used entries)", pages)
    return (pages * page_size + pos % page_size).to(_I32)
