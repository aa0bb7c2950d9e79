"""Replay-time metadata of a CUDA-graph batch from the engine's page table: one Triton launch.

vLLM hands a backend ``seq_lens [n]`` and ``block_table [n, W]`` on the device every step. Turning
them into the core's page CSR (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``), ``kv_lens``,
FA3's padded block table and, for spec-decode verify, the causal-chain mask with fixed-shape torch
ops took ~30 launches per step (searchsorted, index_select, cumsum, masked fills ...); this kernel
writes all of them at once, in place, with no host sync and no allocation. SGLang's token-level
``req_to_token`` rows, picked by ``req_pool_indices``, are read the same way (``row_ids``,
``entry_tokens = P``).

Padded requests (``seq_lens <= 0``, and rows ``n..bs-1``) become the core's padded request
(``pad_kv_len`` tokens on ``pad_page``; an all-True mask block), as ``GraphState.update`` pads.

Shared prefix (cascade under CUDA graphs, decode and verify): :func:`batch_shared_pages` finds the leading
page ids every real request shares with request 0 (one launch, an atomic minimum), and the update
launch then writes each real request's *suffix* (its pages after the shared ones) and the shared
pages as a one-request prefix batch, when the saving clears the cost model's bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def graph_batch_from_block_table_kernel(
    SEQ,
    BT,
    stride_bt_row,
    stride_bt_col,
    n,
    W,
    ROW_IDX,
    KV_INDPTR,
    KV_INDICES,
    KV_LAST,
    KV_LENS,
    BT_OUT,
    stride_bo_row,
    MASK,
    MASK_INDPTR,
    MASK_FREE,
    SHARED,
    P_INDPTR,
    P_INDICES,
    P_LENS,
    COUNTS,
    ACTIVE,
    min_saved_pages,
    page_size,
    pad_page,
    pad_kv_len,
    Q: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_BT_OUT: tl.constexpr,
    CHAIN_MASK: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr,
    ENTRY_TOKENS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
):
    """Grid ``(bs,)``: program ``b`` writes request ``b``'s pages (and mask block); program 0 also
    writes the per-request vectors. Every program recomputes the ``bs`` prefix sums (``bs <= BLOCK_B``).
    ``HAS_SHARED``: ``SHARED[0]`` leading pages are common to the real requests; when ``(n - 1) *
    SHARED[0] >= min_saved_pages`` they are cut from every real request and program 0 writes them as
    the prefix batch (``P_INDPTR [2]``, ``P_INDICES``, ``P_LENS [1]``), else the prefix batch is empty;
    program 0 then adds ``(1, cut tokens)`` to ``COUNTS [2]`` int64 when it cut a prefix and writes
    whether it did to ``ACTIVE`` (0-dim bool: the predicate of the prefix part's graph IF node)."""
    b = tl.program_id(0)
    bs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_B)
    live = rows < bs
    s = tl.load(SEQ + rows, mask=rows < n, other=0).to(tl.int32)
    padrow = (s <= 0) & live
    s = tl.where(padrow, pad_kv_len, s)
    s = tl.where(live, s, 0)
    skip = 0
    if HAS_SHARED:
        shared = tl.load(SHARED).to(tl.int32)
        skip = tl.where((n - 1) * shared >= min_saved_pages, shared, 0)
        s = tl.where(live & (padrow == 0), s - skip * page_size, s)  # real requests keep their suffix
    npg = (s + page_size - 1) // page_size
    me = rows == b
    s_b = tl.sum(tl.where(me, s, 0), axis=0)
    npg_b = tl.sum(tl.where(me, npg, 0), axis=0)
    pad_b = tl.sum(tl.where(me & padrow, 1, 0), axis=0) > 0
    start = tl.sum(tl.where(rows < b, npg, 0), axis=0)
    if b == 0:
        tl.store(KV_INDPTR + rows, 0, mask=rows == 0)
        tl.store(KV_INDPTR + 1 + rows, tl.cumsum(npg, 0), mask=live)
        tl.store(KV_LAST + rows, s - (npg - 1) * page_size, mask=live)
        tl.store(KV_LENS + rows, s, mask=live)
        if CHAIN_MASK:
            tl.store(MASK_INDPTR + rows, tl.zeros([BLOCK_B], dtype=tl.int64), mask=rows == 0)
            tl.store(MASK_INDPTR + 1 + rows, tl.cumsum(s.to(tl.int64) * Q, 0), mask=live)
            tl.store(MASK_FREE + rows, s - Q, mask=live)
    read = (b < n) & (pad_b == 0)  # a real row of the engine's table
    r = b.to(tl.int64)
    if HAS_ROW_IDX:
        r = tl.load(ROW_IDX + b, mask=read, other=0).to(tl.int64)
    row = BT + r * stride_bt_row
    skip_b = 0
    if HAS_SHARED:
        skip_b = tl.where(read, skip, 0)
        if b == 0:  # the prefix batch: request 0's first `skip` pages (empty when not cut)
            tl.store(P_INDPTR + rows, tl.where(rows == 0, 0, skip), mask=rows < 2)
            tl.store(P_LENS, skip * page_size)
            cut = (skip > 0).to(tl.int64)
            tl.store(COUNTS, tl.load(COUNTS) + cut)
            tl.store(COUNTS + 1, tl.load(COUNTS + 1) + skip.to(tl.int64) * page_size)
            tl.store(ACTIVE, skip > 0)
            for j0 in range(0, skip, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                col = j.to(tl.int64) * ENTRY_TOKENS
                page = tl.load(row + col * stride_bt_col, mask=j < skip, other=0) // ENTRY_TOKENS
                tl.store(P_INDICES + j, page.to(tl.int32), mask=j < skip)
    for j0 in range(0, npg_b, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        m = j < npg_b
        col = (j + skip_b).to(tl.int64) * ENTRY_TOKENS  # token-level tables: each page's first token slot
        # `read` folded into the bound (a scalar bool `&` a block mask is int32 under triton 3.9's interpreter)
        page = tl.load(row + col * stride_bt_col, mask=m & (col < tl.where(read, W, 0)), other=pad_page * ENTRY_TOKENS)
        page = page // ENTRY_TOKENS
        tl.store(KV_INDICES + start + j, page.to(tl.int32), mask=m)
        if HAS_BT_OUT:
            tl.store(BT_OUT + b.to(tl.int64) * stride_bo_row + j, page.to(tl.int32), mask=m)
    if CHAIN_MASK:
        # request b's row-major [Q, kv_len] block: (i, c) visible iff c <= kv_len - Q + i
        mstart = tl.sum(tl.where(rows < b, s, 0).to(tl.int64), axis=0) * Q
        total = s_b * Q
        for e0 in range(0, total, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            i = e // s_b
            c = e - i * s_b
            val = (c <= s_b - Q + i) | pad_b
            tl.store(MASK + mstart + e, val.to(tl.uint8), mask=e < total)


@triton.jit
def shared_pages_kernel(
    SEQ,
    BT,
    stride_bt_row,
    stride_bt_col,
    n,
    W,
    ROW_IDX,
    SHARED,
    page_size,
    q,
    BLOCK_J: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr,
    ENTRY_TOKENS: tl.constexpr,
):
    """Grid ``(n,)``, ``SHARED[0]`` preset to a bound: program ``b`` lowers it to the number of leading
    page ids request ``b`` shares with request 0, within its shareable pages ``(seq_lens[b] - q) // P``
    (this step's ``q`` query tokens are never shared). A padding row (``seq_lens <= 0``) at 0
    leaves nothing shared; elsewhere padding rows take no part."""
    b = tl.program_id(0)
    s_b = tl.load(SEQ + b).to(tl.int32)
    s_0 = tl.load(SEQ).to(tl.int32)
    if s_0 <= 0:
        tl.atomic_min(SHARED, 0)
    elif s_b > 0:
        lim = tl.maximum(tl.minimum((s_b - q) // page_size, (s_0 - q) // page_size), 0)
        lim = tl.minimum(lim, W // ENTRY_TOKENS)
        r0 = tl.zeros([], dtype=tl.int64)
        rb = b.to(tl.int64)
        if HAS_ROW_IDX:
            r0 = tl.load(ROW_IDX).to(tl.int64)
            rb = tl.load(ROW_IDX + b).to(tl.int64)
        first = lim
        for j0 in range(0, lim, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            m = j < lim
            col = j.to(tl.int64) * ENTRY_TOKENS * stride_bt_col
            p0 = tl.load(BT + r0 * stride_bt_row + col, mask=m, other=0) // ENTRY_TOKENS
            pb = tl.load(BT + rb * stride_bt_row + col, mask=m, other=0) // ENTRY_TOKENS
            first = tl.minimum(first, tl.min(tl.where(m & (p0 != pb), j, lim), axis=0))
        tl.atomic_min(SHARED, first)


def batch_shared_pages(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    shared: torch.Tensor,
    row_ids: torch.Tensor | None = None,
    entry_tokens: int = 1,
    q: int = 1,
) -> None:
    """``shared [1]`` int32 <- the leading page ids every real request of the engine's table shares
    with request 0 (within each one's ``(seq_lens - q) // page_size`` shareable pages: ``q`` query
    tokens a request); 0 with fewer than two requests. Device work only (a fill and one launch, grid
    ``(n,)``): no sync. Arguments as :func:`graph_batch_from_block_table`'s."""
    n = seq_lens.shape[0]
    shared.fill_(0 if n < 2 else 1 << 30)
    if n < 2:
        return
    W = block_table.shape[1] if block_table.dim() == 2 else 0
    shared_pages_kernel[(n,)](
        seq_lens,
        block_table,
        block_table.stride(0),
        block_table.stride(1) if W else 1,
        n,
        W,
        seq_lens if row_ids is None else row_ids,
        shared,
        page_size,
        q,
        BLOCK_J=128,
        HAS_ROW_IDX=row_ids is not None,
        ENTRY_TOKENS=entry_tokens,
    )


def graph_batch_from_block_table(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    bs: int,
    page_size: int,
    pad_page: int,
    pad_kv_len: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table_out: torch.Tensor | None = None,
    q: int = 1,
    mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    mask_free: torch.Tensor | None = None,
    max_batch: int | None = None,
    row_ids: torch.Tensor | None = None,
    entry_tokens: int = 1,
    shared: torch.Tensor | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    min_saved_pages: int = 1,
    counts: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> None:
    """Write a padded batch of ``bs`` requests into static buffers, in one launch.

    Args:
        seq_lens: ``[n]`` int32 / int64, ``n <= bs``: KV length of each request including this
            step's ``q`` query tokens; ``<= 0`` marks an engine padding row.
        block_table: ``[rows, W]`` int32 / int64 page ids (any strides); request ``b`` reads row ``b``,
            or ``row_ids[b]``. With ``entry_tokens = P`` a token-level table (SGLang's ``req_to_token``:
            token slot ids, ``W`` tokens per row): page ``j`` = ``table[row, j * P] // P``.
        bs: padded batch size; rows ``n..bs-1`` are padded requests.
        page_size, pad_page, pad_kv_len: page size; page and KV length of a padded request.
        kv_indptr ``[>= bs+1]`` int32, kv_indices ``[>= nnz]`` int32, kv_last_page_len ``[>= bs]``
            int32, kv_lens ``[>= bs]`` int32: outputs (CSR of the padded batch).
        block_table_out: optional ``[>= bs, >= max pages of a request]`` int32, row stride any, column
            stride 1: the padded batch as a block table (FA3); only each row's first pages are written.
        q, mask ``[>= sum q*kv_len]`` uint8, mask_indptr ``[>= bs+1]`` int64, mask_free ``[>= bs]``
            int32: with ``mask``, the causal-chain verify mask (prefix + chain; padded rows all True).
        row_ids: optional ``[>= n]`` int32 / int64 table row of each request (SGLang's ``req_pool_indices``).
        entry_tokens: table entries per page (1: a page table; ``P``: a token-slot table).
        max_batch: largest ``bs`` this call site uses (sizes the in-kernel prefix sum; default ``bs``),
            so that every ``bs`` reuses one compiled kernel.
        shared: optional ``[1]`` int32, leading pages common to the real requests
            (:func:`batch_shared_pages`); with ``prefix = (kv_indptr [2], kv_indices [>= shared],
            kv_lens [1])`` int32 and ``(n - 1) * shared >= min_saved_pages``, the shared pages are
            written as a one-request prefix batch and cut from every real request (the outputs then
            describe the suffixes); otherwise the prefix batch is empty and the requests whole.
        counts: ``[2]`` int64, required with ``shared``: ``+= (1, shared tokens)`` when a prefix is
            cut (the proof counters, read later without a sync).
        active: 0-dim bool, required with ``shared``: whether a prefix was cut.

    Capacities are not checked (that would sync): every real request must be ``<= W`` pages, and the
    outputs sized for ``bs`` requests of the graph family's largest length (``GraphState`` is).
    """
    n = seq_lens.shape[0]
    if not 0 <= n <= bs:
        raise ValueError(f"seq_lens has {n} rows, expected 0..bs={bs}")
    if n and row_ids is None and block_table.shape[0] < n:
        raise ValueError(f"block_table has {block_table.shape[0]} rows < {n} requests")
    if block_table_out is not None and block_table_out.stride(1) != 1:
        raise ValueError("block_table_out needs a contiguous column dim")
    chain = mask is not None
    dummy = kv_lens
    if len({shared is None, prefix is None, counts is None, active is None}) > 1:
        raise ValueError("shared, prefix, counts and active go together")
    W = block_table.shape[1] if block_table.dim() == 2 else 0
    graph_batch_from_block_table_kernel[(bs,)](
        seq_lens,
        block_table,
        block_table.stride(0),
        block_table.stride(1) if W else 1,
        n,
        W,
        seq_lens if row_ids is None else row_ids,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        kv_lens,
        dummy if block_table_out is None else block_table_out,
        0 if block_table_out is None else block_table_out.stride(0),
        mask if chain else dummy,
        mask_indptr if chain else dummy,
        mask_free if chain else dummy,
        *((shared, *prefix, counts, active) if shared is not None else (dummy,) * 6),
        max(1, int(min_saved_pages)),
        page_size,
        pad_page,
        pad_kv_len,
        Q=q,
        BLOCK_B=triton.next_power_of_2(max(bs, max_batch or 1)),
        BLOCK_J=128,
        BLOCK_E=1024,
        HAS_BT_OUT=block_table_out is not None,
        CHAIN_MASK=chain,
        HAS_ROW_IDX=row_ids is not None,
        ENTRY_TOKENS=entry_tokens,
        HAS_SHARED=shared is not None,
    )
