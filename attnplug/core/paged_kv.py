"""Engine-agnostic paged-KV manager: page allocator, per-request page tables, fork with
copy-on-write, and prefix sharing through a :class:`~attnplug.core.radix_tree.RadixCache`.

Ownership: every page has a reference count equal to the number of its owners -- each request
whose page table lists it, plus each radix-tree node holding it. A page returns to the free list
when its count drops to 0. Only full pages are ever shared; a request's partial last page is
always private (``fork`` copies it), so appending tokens never writes a page another owner sees.
The manager only does bookkeeping; KV tensors are the caller's (see :func:`apply_page_copies`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .kv_layout import KVLayout
from .page_table import slot_mapping as _slot_mapping
from .radix_tree import RadixCache, RadixNode

__all__ = ["OutOfPages", "PageAllocator", "PagedKVManager", "apply_page_copies"]


class OutOfPages(RuntimeError):
    """Not enough free pages (after evicting the prefix cache, if any)."""


class PageAllocator:
    """Free list + reference counts over page ids ``0..num_pages-1``."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """Copy of the free list."""
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages (refcount 1 each); raises :class:`OutOfPages` if fewer are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfPages(f"requested {n} pages but only {len(self._free)} of {self.num_pages} are free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page must be in 0..{self.num_pages - 1}, got {page}")
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} is not allocated (double free or use after free)")

    def incref(self, page: int) -> None:
        """Add an owner to an allocated page."""
        self._check(page)
        self.refcount[page] += 1

    def decref(self, page: int) -> bool:
        """Drop an owner; returns True when the page went back to the free list."""
        self._check(page)
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)
            return True
        return False

    def free(self, pages: Iterable[int]) -> list[int]:
        """:meth:`decref` each page; returns those that went back to the free list."""
        return [p for p in pages if self.decref(p)]


@dataclass
class _Request:
    pages: list[int]
    num_tokens: int
    locks: list[RadixNode] = field(default_factory=list)


def apply_page_copies(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    copies: Sequence[tuple[int, int]],
    layout: KVLayout | str = KVLayout.NHD,
) -> None:
    """Perform copy-on-write page copies ``[(src_page, dst_page)]`` on both caches in place.

    The page dim is dim 0 in every layout; ``layout`` is accepted for symmetry.
    """
    KVLayout(layout)
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=k_cache.device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=k_cache.device)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


class PagedKVManager:
    """Per-request page tables over a shared page pool, with optional radix prefix cache.

    Args:
        num_pages: pool size.
        page_size: tokens per page ``P``.
        enable_prefix_cache: create a :class:`RadixCache` (or pass ``radix_cache``).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_cache: bool = False,
        radix_cache: RadixCache | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        if radix_cache is None and enable_prefix_cache:
            radix_cache = RadixCache(page_size)
        if radix_cache is not None and radix_cache.page_size != page_size:
            raise ValueError(f"radix_cache.page_size must be {page_size}, got {radix_cache.page_size}")
        self.radix_cache = radix_cache
        self._reqs: dict[Hashable, _Request] = {}

    # -- internals -----------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _req(self, rid: Hashable) -> _Request:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"unknown request {rid!r}") from None

    def _alloc(self, n: int) -> list[int]:
        """Allocate ``n`` pages, evicting unlocked prefix-cache pages (LRU) if needed.

        On :class:`OutOfPages` the caller's state is untouched, but cache pages evicted while
        trying stay evicted.
        """
        a, tree = self.allocator, self.radix_cache
        while a.num_free < n and tree is not None and tree.evictable_pages() > 0:
            a.free(tree.evict(n - a.num_free))
        return a.alloc(n)

    # -- requests ------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def requests(self) -> list[Hashable]:
        return list(self._reqs)

    def add_request(self, rid: Hashable, tokens: int | Sequence[int], *, match_last: bool = False) -> int:
        """Register a request and allocate pages for its tokens.

        Args:
            tokens: a token count, or the token ids; with ids and a prefix cache, the longest cached
                page-aligned prefix is reused (pages shared by refcount, tree path locked).
            match_last: allow the match to cover the last token (default False keeps at least one
                token to compute, so the engine gets logits).

        Returns:
            Number of leading tokens whose KV is already cached (0 without a prefix match); the
            caller writes KV for the remaining tokens only.
        """
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} already exists")
        n = tokens if isinstance(tokens, int) else len(tokens)
        if n < 0:
            raise ValueError(f"num_tokens must be >= 0, got {n}")
        matched, pages, locks = 0, [], []
        tree = self.radix_cache
        if tree is not None and not isinstance(tokens, int):
            matched, pages, node = tree.match_prefix(tokens if match_last else tokens[: max(n - 1, 0)])
            if matched:
                tree.lock(node)
                locks.append(node)
                for p in pages:
                    self.allocator.incref(p)
        try:
            pages = pages + self._alloc(self._pages_for(n) - len(pages))
        except OutOfPages:
            self.allocator.free(pages)
            for node in locks:
                tree.unlock(node)  # type: ignore[union-attr]
            raise
        self._reqs[rid] = _Request(pages, n, locks)
        return matched

    def extend(self, rid: Hashable, n: int) -> list[int]:
        """Grow request ``rid`` by ``n`` tokens; returns the newly allocated pages (atomic on OOM)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        r = self._req(rid)
        new = self._alloc(self._pages_for(r.num_tokens + n) - len(r.pages))
        r.pages.extend(new)
        r.num_tokens += n
        return new

    def fork(self, src_rid: Hashable, dst_rid: Hashable) -> list[tuple[int, int]]:
        """Create ``dst_rid`` as a copy of ``src_rid``: full pages shared, partial last page copied.

        Returns:
            ``[(src_page, dst_page)]`` copies the caller must apply to the KV caches
            (:func:`apply_page_copies`) before either request writes again.
        """
        if dst_rid in self._reqs:
            raise ValueError(f"request {dst_rid!r} already exists")
        src = self._req(src_rid)
        partial = src.num_tokens % self.page_size != 0
        copies: list[tuple[int, int]] = []
        new = self._alloc(1) if partial else []
        shared = src.pages[:-1] if partial else list(src.pages)
        for p in shared:
            self.allocator.incref(p)
        if partial:
            copies.append((src.pages[-1], new[0]))
        for node in src.locks:
            self.radix_cache.lock(node)  # type: ignore[union-attr]
        self._reqs[dst_rid] = _Request(shared + new, src.num_tokens, list(src.locks))
        return copies

    def free_request(self, rid: Hashable) -> list[int]:
        """Release a request; returns the pages that went back to the free list."""
        r = self._req(rid)
        del self._reqs[rid]
        for node in r.locks:
            self.radix_cache.unlock(node)  # type: ignore[union-attr]
        return self.allocator.free(r.pages)

    def cache_request(self, rid: Hashable, token_ids: Sequence[int]) -> int:
        """Insert the full pages of ``rid`` (KV of ``token_ids``) into the prefix cache.

        Only ``min(len(token_ids), seq_len(rid)) // P`` pages are inserted; the tree takes a
        reference on each page it adopts. Returns the number of tokens that were already cached.
        """
        if self.radix_cache is None:
            raise RuntimeError("cache_request needs a prefix cache (enable_prefix_cache=True)")
        r = self._req(rid)
        n_full = min(len(token_ids), r.num_tokens) // self.page_size
        present = self.radix_cache.insert(token_ids[: n_full * self.page_size], r.pages[:n_full])
        for p in r.pages[present // self.page_size : n_full]:
            self.allocator.incref(p)
        return present

    def page_table(self, rid: Hashable) -> list[int]:
        """Copy of the page ids of ``rid`` (``ceil(seq_len / P)`` entries)."""
        return list(self._req(rid).pages)

    def seq_len(self, rid: Hashable) -> int:
        return self._req(rid).num_tokens

    # -- batch builders ------------------------------------------------------------------------
    def csr(
        self, rids: Sequence[Hashable], device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer CSR of ``rids``: ``kv_indptr [B+1]``, ``kv_indices [nnz]``, ``kv_last_page_len [B]`` int32."""
        reqs = [self._req(r) for r in rids]
        counts = torch.tensor([len(r.pages) for r in reqs], dtype=torch.int32)
        indptr = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(counts, 0)
        indices = torch.tensor([p for r in reqs for p in r.pages], dtype=torch.int32)
        last = torch.tensor(
            [(r.num_tokens - 1) % self.page_size + 1 if r.num_tokens else 0 for r in reqs], dtype=torch.int32
        )
        return indptr.to(device), indices.to(device), last.to(device)

    def block_table(
        self, rids: Sequence[Hashable], max_pages: int | None = None, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_table [B, max_pages]`` int32 (padding 0) and ``seq_lens [B]`` int32."""
        reqs = [self._req(r) for r in rids]
        need = max((len(r.pages) for r in reqs), default=0)
        if max_pages is None:
            max_pages = need
        elif max_pages < need:
            raise ValueError(f"max_pages must be >= {need}, got {max_pages}")
        bt = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
        for i, r in enumerate(reqs):
            bt[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        seq_lens = torch.tensor([r.num_tokens for r in reqs], dtype=torch.int32)
        return bt.to(device), seq_lens.to(device)

    def slot_mapping(
        self, rids: Sequence[Hashable], positions: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Slot ids ``[T]`` int32 for tokens at ``positions[i]`` of request ``rids[i]`` (one rid per token)."""
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        if len(rids) != pos.shape[0]:
            raise ValueError(f"rids must have one entry per position ({pos.shape[0]}), got {len(rids)}")
        order = list(dict.fromkeys(rids))
        row = {r: i for i, r in enumerate(order)}
        lens = torch.tensor([self._req(r).num_tokens for r in order], dtype=torch.int64)
        req_ids = torch.tensor([row[r] for r in rids], dtype=torch.int64)
        if pos.numel() and bool(((pos < 0) | (pos >= lens[req_ids])).any()):
            i = int(((pos < 0) | (pos >= lens[req_ids])).nonzero()[0, 0])
            raise ValueError(
                f"positions[{i}] = {int(pos[i])} must be in 0..seq_len({rids[i]!r}) - 1 = {int(lens[req_ids[i]]) - 1}"
            )
        bt, _ = self.block_table(order)
        return _slot_mapping(bt, pos, req_ids, self.page_size, check=False).to(device)

    # -- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute refcounts and locks from all owners; raises AssertionError on any mismatch."""
        a, tree, p = self.allocator, self.radix_cache, self.page_size
        owners: Counter[int] = Counter()
        for rid, r in self._reqs.items():
            assert len(r.pages) == self._pages_for(r.num_tokens), (
                f"{rid!r}: {len(r.pages)} pages for {r.num_tokens} tokens"
            )
            assert len(set(r.pages)) == len(r.pages), f"{rid!r}: duplicate page in {r.pages}"
            owners.update(r.pages)
            if r.num_tokens % p:
                assert a.refcount[r.pages[-1]] == 1, f"{rid!r}: partial last page {r.pages[-1]} is shared"
        if tree is not None:
            tree.check_invariants()
            owners.update(tree.all_pages())
        for page in range(a.num_pages):
            assert a.refcount[page] == owners[page], (
                f"page {page}: refcount {a.refcount[page]} != owners {owners[page]}"
            )
        assert set(owners) <= set(range(a.num_pages)), "owner of an out-of-range page"
        free = a.free_pages()
        assert len(set(free)) == len(free), "duplicate page in the free list"
        assert set(free) == {q for q in range(a.num_pages) if a.refcount[q] == 0}, "free list != pages with refcount 0"
        if tree is not None:
            locks: Counter[int] = Counter()
            for r in self._reqs.values():
                for node in r.locks:
                    n: RadixNode | None = node
                    while n is not None:
                        locks[id(n)] += 1
                        top, n = n, n.parent
                    assert top is tree.root, f"locked node {node!r} is not in the tree"
            for node in tree.nodes():
                want = locks[id(node)] + (1 if node is tree.root else 0)
                assert node.lock_ref == want, f"{node!r}: lock_ref {node.lock_ref} != {want}"
