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

Shared prefix (cascade under CUDA graphs, decode and verify): :func:`batch_shared_pages` finds the groups
(maximal runs of consecutive requests starting on one page) and the leading page ids each group's members
share (one launch, an atomic minimum per group), and the update launch then writes each real request's
*suffix* (its pages after its group's shared ones) and every group whose saving clears the cost model's
bound as one request of the prefix batch (its members' query rows, its shared pages), with the prefix
part's tile list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..providers.base import GraphTiles


@dataclass
class PrefixCut:
    """The cascade cut of a one-launch update (:func:`graph_batch_from_block_table`): the groups
    (:func:`batch_shared_pages`'s ``shared`` / ``group_start`` / ``group_end [>= n]`` int32), the prefix
    batch it writes (``bs + 1`` slots: ``qo_indptr`` / ``kv_indptr [>= bs+2]``, ``kv_indices``, ``kv_lens``
    / ``kv_last_page_len [>= bs+1]`` int32), the proof counters ``counts [3]`` int64 and ``active``
    (0-dim bool), the cost model's bound and the prefix part's tile list
    (:class:`~attnplug.core.providers.base.GraphTiles`; ``None``: its provider reads no tile list)."""

    shared: torch.Tensor
    group_start: torch.Tensor
    group_end: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    kv_last_page_len: torch.Tensor
    counts: torch.Tensor
    active: torch.Tensor
    min_saved_pages: int = 1
    tiles: GraphTiles | None = None

    def launch_tensors(self) -> tuple[torch.Tensor, ...]:
        """The kernel's 13 cut arguments, in its order (a missing tile list or count: ``counts`` stands in)."""
        tiles = self.tiles[:2] if self.tiles is not None else (self.counts, self.counts)
        count = self.tiles.count if self.tiles is not None and self.tiles.count is not None else self.counts
        return (
            self.shared,
            self.group_start,
            self.group_end,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            self.kv_lens,
            self.kv_last_page_len,
            *tiles,
            count,
            self.counts,
            self.active,
        )


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
    SRC_MASK,
    SHARED,
    GSTART,
    GEND,
    P_QO,
    P_INDPTR,
    P_INDICES,
    P_LENS,
    P_LAST,
    TILE_REQ,
    TILE_Q,
    TILE_COUNT,
    COUNTS,
    ACTIVE,
    min_saved_pages,
    p_block_q,
    max_tiles,
    page_size,
    pad_page,
    pad_kv_len,
    Q: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_E: tl.constexpr,
    HAS_BT_OUT: tl.constexpr,
    CHAIN_MASK: tl.constexpr,
    TREE_MASK: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr,
    ENTRY_TOKENS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_TILES: tl.constexpr = False,
    HAS_TILE_COUNT: tl.constexpr = False,
):
    """Grid ``(bs,)``: program ``b`` writes request ``b``'s pages (and mask block); program 0 also
    writes the per-request vectors. Every program recomputes the ``bs`` prefix sums (``bs <= BLOCK_B``).
    ``HAS_SHARED``: the groups of :func:`shared_pages_kernel` (``GSTART`` / ``GEND [n]``, ``SHARED``
    at each group's first request); a group of ``m >= 2`` requests sharing ``p`` pages with ``(m - 1) * p
    >= min_saved_pages`` is cut: its members keep their suffix, and slot ``g`` of the prefix batch (``g``
    its first request; ``bs + 1`` slots, the last always empty) holds its members' query rows and its
    ``p`` pages: ``P_QO [bs+2]``, ``P_INDPTR [bs+2]``, ``P_INDICES``, ``P_LENS`` / ``P_LAST [bs+1]``.
    Every other slot has no keys. ``HAS_TILES``: the prefix part's tile list ``TILE_REQ`` / ``TILE_Q
    [max_tiles]`` (tiles of ``p_block_q`` rows: every slot's rows, then empty tiles on slot ``bs``;
    ``HAS_TILE_COUNT``: only the cut groups' slots, their number to ``TILE_COUNT [1]``).
    Program 0 adds ``(1 if any group was cut, cut tokens, cut groups)`` to ``COUNTS [3]`` int64 and
    writes whether any was cut to ``ACTIVE`` (0-dim bool: the predicate of the prefix part's graph IF
    node). ``TREE_MASK``: the verify mask is the engine's ``SRC_MASK`` (request ``b``'s row-major ``[Q,
    seq_b]`` block after the real requests before it), its last ``Q`` columns copied (the tree part), the
    committed prefix before them visible (the verify graphs' contract; the cut prefix dropped)."""
    b = tl.program_id(0)
    bs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_B)
    live = rows < bs
    s = tl.load(SEQ + rows, mask=rows < n, other=0).to(tl.int32)
    padrow = (s <= 0) & live
    s = tl.where(padrow, pad_kv_len, s)
    s = tl.where(live, s, 0)
    s_src = tl.where(padrow, 0, s)  # the engine's lengths (TREE_MASK: its blocks' widths), before any cut
    skip = tl.zeros([BLOCK_B], dtype=tl.int32)
    gst = rows
    gen = rows + 1
    if HAS_SHARED:
        real = rows < n
        gst = tl.where(real, tl.load(GSTART + rows, mask=real, other=0), rows)
        gen = tl.where(real, tl.load(GEND + rows, mask=real, other=0), rows + 1)
        found = tl.load(SHARED + gst, mask=real, other=0).to(tl.int32)
        members = gen - gst
        pay = real & (members >= 2) & (found > 0) & ((members - 1) * found >= min_saved_pages)
        skip = tl.where(pay, found, 0)
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
        if CHAIN_MASK or TREE_MASK:
            tl.store(MASK_INDPTR + rows, tl.zeros([BLOCK_B], dtype=tl.int64), mask=rows == 0)
            tl.store(MASK_INDPTR + 1 + rows, tl.cumsum(s.to(tl.int64) * Q, 0), mask=live)
            tl.store(MASK_FREE + rows, s - Q, mask=live)
    read = (b < n) & (pad_b == 0)  # a real row of the engine's table
    r = b.to(tl.int64)
    if HAS_ROW_IDX:
        r = tl.load(ROW_IDX + b, mask=read, other=0).to(tl.int64)
    row = BT + r * stride_bt_row
    skip_b = tl.sum(tl.where(me, skip, 0), axis=0)
    if HAS_SHARED:  # the prefix batch: slot g = group g's rows over its first request's cut pages
        lead = live & (gst == rows)
        c = tl.where(lead, skip, 0)
        p_end = tl.cumsum(c, 0)
        tiled = lead & (c > 0) if HAS_TILE_COUNT else lead
        t = tl.where(tiled, tl.cdiv((gen - rows) * Q, p_block_q), 0)
        t_end = tl.cumsum(t, 0)
        if b == 0:
            tl.store(P_QO + rows, Q * tl.where(lead, rows, gen), mask=live)
            tl.store(P_QO + bs, bs * Q)  # slot bs: no rows, no keys
            tl.store(P_QO + bs + 1, bs * Q)
            total = tl.sum(c, axis=0)
            tl.store(P_INDPTR, 0)
            tl.store(P_INDPTR + 1 + rows, p_end, mask=live)
            tl.store(P_INDPTR + bs + 1, total)
            tl.store(P_LENS + rows, c * page_size, mask=live)
            tl.store(P_LAST + rows, tl.where(c > 0, page_size, 0), mask=live)
            tl.store(P_LENS + bs, 0)
            tl.store(P_LAST + bs, 0)
            groups = tl.sum(tl.where(c > 0, 1, 0), axis=0).to(tl.int64)
            tl.store(COUNTS, tl.load(COUNTS) + (groups > 0).to(tl.int64))
            tl.store(COUNTS + 1, tl.load(COUNTS + 1) + total.to(tl.int64) * page_size)
            tl.store(COUNTS + 2, tl.load(COUNTS + 2) + groups)
            tl.store(ACTIVE, groups > 0)
            if HAS_TILE_COUNT:
                tl.store(TILE_COUNT, tl.sum(t, axis=0))
            elif HAS_TILES:  # the tiles past the slots' own: empty ones, on slot bs
                for k0 in range(tl.sum(t, axis=0), max_tiles, BLOCK_J):
                    k = k0 + tl.arange(0, BLOCK_J)
                    tl.store(TILE_REQ + k, bs + k * 0, mask=k < max_tiles)
                    tl.store(TILE_Q + k, k * 0, mask=k < max_tiles)
        c_b = tl.sum(tl.where(me, c, 0), axis=0)
        if HAS_TILES:
            t_b = tl.sum(tl.where(me, t, 0), axis=0)
            t0 = tl.sum(tl.where(me, t_end - t, 0), axis=0)
            for k0 in range(0, t_b, BLOCK_J):
                k = k0 + tl.arange(0, BLOCK_J)
                tl.store(TILE_REQ + t0 + k, b + k * 0, mask=k < t_b)
                tl.store(TILE_Q + t0 + k, k * p_block_q, mask=k < t_b)
        p0 = tl.sum(tl.where(me, p_end - c, 0), axis=0)
        for j0 in range(0, c_b, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            col = j.to(tl.int64) * ENTRY_TOKENS
            page = tl.load(row + col * stride_bt_col, mask=j < c_b, other=0) // ENTRY_TOKENS
            tl.store(P_INDICES + p0 + j, page.to(tl.int32), mask=j < c_b)
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
    if CHAIN_MASK or TREE_MASK:
        # request b's row-major [Q, kv_len] block: a chain shows (i, c) iff c <= kv_len - Q + i; a tree shows
        # the prefix columns and takes the last Q from the engine's block (loop names apart from the cut's
        # block names above: a loop-carried variable keeps its shape)
        mstart = tl.sum(tl.where(rows < b, s, 0).to(tl.int64), axis=0) * Q
        m_total = s_b * Q
        if TREE_MASK:
            src_w = tl.sum(tl.where(me, s_src, 0), axis=0).to(tl.int64)
            src0 = tl.sum(tl.where(rows < b, s_src, 0).to(tl.int64), axis=0) * Q + src_w - Q
        for e0 in range(0, m_total, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            i = e // s_b
            m_col = e - i * s_b
            if CHAIN_MASK:
                val = (m_col <= s_b - Q + i) | pad_b
            else:
                t_col = m_col - (s_b - Q)  # column within the tree part (< 0: the prefix)
                # a padded row has no tree part (folded into the bound: a scalar bool `&` a block mask is
                # int32 under triton 3.9's interpreter)
                tree = (e < m_total) & (t_col >= tl.where(pad_b, m_total, 0))
                src = tl.load(SRC_MASK + src0 + i * src_w + t_col, mask=tree, other=1)
                val = (src != 0) | (tree == 0)
            tl.store(MASK + mstart + e, val.to(tl.uint8), mask=e < m_total)


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
    GSTART,
    GEND,
    page_size,
    q,
    BLOCK_B: tl.constexpr,
    BLOCK_J: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr,
    ENTRY_TOKENS: tl.constexpr,
):
    """Grid ``(n,)``, ``SHARED[:n]`` preset to a bound. The groups: maximal runs of consecutive requests
    whose first page ids are equal, each with at least one shareable page ``(seq_lens - q) // P`` (this
    step's ``q`` query tokens are never shared; a padding row, ``seq_lens <= 0``, has none). Program
    ``b`` writes its group's first request ``GSTART[b]`` and end ``GEND[b]`` (exclusive) and lowers
    ``SHARED[GSTART[b]]`` to the leading page ids it shares with that first request, within both
    one's shareable pages (0 for a group of one)."""
    b = tl.program_id(0)
    rows = tl.arange(0, BLOCK_B)
    live = rows < n
    prev = live & (rows >= 1)
    s = tl.load(SEQ + rows, mask=live, other=0).to(tl.int32)
    sp = tl.load(SEQ + rows - 1, mask=prev, other=0).to(tl.int32)
    cap = W // ENTRY_TOKENS
    sh = tl.minimum(tl.maximum(s - q, 0) // page_size, cap)
    sh_p = tl.minimum(tl.maximum(sp - q, 0) // page_size, cap)
    r = rows.to(tl.int64)
    rp = (rows - 1).to(tl.int64)
    if HAS_ROW_IDX:
        r = tl.load(ROW_IDX + rows, mask=live, other=0).to(tl.int64)
        rp = tl.load(ROW_IDX + rows - 1, mask=prev, other=0).to(tl.int64)
    first = tl.load(BT + r * stride_bt_row, mask=live & (sh > 0), other=-1) // ENTRY_TOKENS
    first_p = tl.load(BT + rp * stride_bt_row, mask=prev & (sh_p > 0), other=-2) // ENTRY_TOKENS
    link = prev & (sh > 0) & (sh_p > 0) & (first == first_p)  # row continues the group of the row before
    gid = tl.cumsum(tl.where(live & (link == 0), 1, 0), 0)  # 1-based group id of each row
    gid_b = tl.sum(tl.where(rows == b, gid, 0), axis=0)
    start = tl.sum(tl.where(live & (gid < gid_b), 1, 0), axis=0)
    end = tl.sum(tl.where(live & (gid <= gid_b), 1, 0), axis=0)
    tl.store(GSTART + b, start)
    tl.store(GEND + b, end)
    sh_b = tl.sum(tl.where(rows == b, sh, 0), axis=0)
    sh_0 = tl.sum(tl.where(rows == start, sh, 0), axis=0)
    lim = tl.minimum(sh_b, sh_0)
    r0 = tl.sum(tl.where(rows == start, r, 0), axis=0)
    rb = tl.sum(tl.where(rows == b, r, 0), axis=0)
    first_diff = tl.where(end - start >= 2, lim, 0)
    for j0 in range(0, tl.where(b > start, lim, 0), BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        m = j < lim
        col = j.to(tl.int64) * ENTRY_TOKENS * stride_bt_col
        p0 = tl.load(BT + r0 * stride_bt_row + col, mask=m, other=0) // ENTRY_TOKENS
        pb = tl.load(BT + rb * stride_bt_row + col, mask=m, other=0) // ENTRY_TOKENS
        first_diff = tl.minimum(first_diff, tl.min(tl.where(m & (p0 != pb), j, lim), axis=0))
    tl.atomic_min(SHARED + start, first_diff)


def batch_shared_pages(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    shared: torch.Tensor,
    group_start: torch.Tensor,
    group_end: torch.Tensor,
    row_ids: torch.Tensor | None = None,
    entry_tokens: int = 1,
    q: int = 1,
    max_batch: int | None = None,
) -> None:
    """The groups of the engine's table (:func:`shared_pages_kernel`): ``group_start [>= n]`` /
    ``group_end [>= n]`` int32 <- each request's group ``[start, end)``, ``shared [>= n]`` int32 <- at each
    group's first request, the leading page ids all its members share (within each one's ``(seq_lens -
    q) // page_size`` shareable pages; 0 for a group of one; other entries ``2**30``). Device work only
    (a fill and one launch, grid ``(n,)``): no sync. ``max_batch``: the largest ``n`` of the call site
    (one compiled kernel). Arguments as :func:`graph_batch_from_block_table`'s."""
    n = seq_lens.shape[0]
    shared[:n].fill_(1 << 30)
    if n == 0:
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
        group_start,
        group_end,
        page_size,
        q,
        BLOCK_B=triton.next_power_of_2(max(n, max_batch or 1)),
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
    cut: PrefixCut | None = None,
    tree_mask: torch.Tensor | None = None,
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
        cut: the cascade cut (:class:`PrefixCut`, its groups found by :func:`batch_shared_pages`): the
            groups that pay are cut from their members (the outputs then describe the suffixes) and
            written as the prefix batch; ``None``: the requests whole.
        tree_mask: with ``mask``, the engine's verify masks (SGLang's ``custom_mask``, bool / uint8): request
            ``b``'s row-major ``[q, seq_lens[b]]`` block after those of the real requests before it; its
            last ``q`` columns (the tree part) are copied, the prefix before them written visible (a mask
            hiding a prefix column is not served: the verify graphs' contract). ``None``: causal chains.

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
    chain, tree = mask is not None and tree_mask is None, tree_mask is not None
    if tree and mask is None:
        raise ValueError("tree_mask needs the mask buffers (mask, mask_indptr, mask_free)")
    if tree and tree_mask.dtype == torch.bool:
        tree_mask = tree_mask.view(torch.uint8)
    dummy = kv_lens
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
        dummy if mask is None else mask,
        dummy if mask is None else mask_indptr,
        dummy if mask is None else mask_free,
        tree_mask if tree else dummy,
        *(cut.launch_tensors() if cut is not None else (dummy,) * 13),
        1 if cut is None else max(1, int(cut.min_saved_pages)),
        1 if cut is None or cut.tiles is None else cut.tiles[2],
        0 if cut is None or cut.tiles is None else cut.tiles[0].numel(),
        page_size,
        pad_page,
        pad_kv_len,
        Q=q,
        BLOCK_B=triton.next_power_of_2(max(bs, max_batch or 1)),
        BLOCK_J=128,
        BLOCK_E=1024,
        HAS_BT_OUT=block_table_out is not None,
        CHAIN_MASK=chain,
        TREE_MASK=tree,
        HAS_ROW_IDX=row_ids is not None,
        ENTRY_TOKENS=entry_tokens,
        HAS_SHARED=cut is not None,
        HAS_TILES=cut is not None and cut.tiles is not None,
        HAS_TILE_COUNT=cut is not None and cut.tiles is not None and cut.tiles.count is not None,
    )
