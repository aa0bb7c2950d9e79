"""Page-granular radix tree for prefix caching (SGLang ``RadixCache`` style).

Keys are token-id sequences, values page-id sequences: a node with key ``k`` (``len(k)`` a multiple
of ``page_size``) holds ``len(k) // page_size`` page ids, page ``j`` caching the KV of tokens
``k[j*P:(j+1)*P]`` after the node's prefix. Node boundaries fall only on page boundaries, so with
``page_size == 1`` this is a plain token radix tree. The tree stores page ids only; it never frees
memory itself -- :meth:`RadixCache.evict` returns the page ids it dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["RadixNode", "RadixCache", "shared_prefix_groups"]


class RadixNode:
    """Tree node: ``key`` tokens (page multiple), ``value`` page ids, ``lock_ref`` users of this path."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "depth")

    def __init__(self, key: tuple[int, ...], value: list[int], parent: RadixNode | None, depth: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.depth = depth  # tokens from the root to the end of this node

    def __repr__(self) -> str:
        return f"RadixNode(depth={self.depth}, tokens={len(self.key)}, pages={self.value}, lock={self.lock_ref})"


class RadixCache:
    """Radix tree over token ids with page-granular nodes and LRU eviction of unlocked leaves."""

    def __init__(self, page_size: int) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.root = RadixNode((), [], None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._total = 0

    # -- helpers -------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        n = len(tokens) - len(tokens) % self.page_size
        return tuple(tokens[:n])

    def _match_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Number of whole pages of ``key`` equal to ``tokens[start:]``."""
        p, n = self.page_size, min(len(key), len(tokens) - start)
        i = 0
        while i + p <= n and key[i : i + p] == tokens[start + i : start + i + p]:
            i += p
        return i // p

    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Split ``node`` after ``pages`` pages; returns the new parent (prefix) node.

        ``node`` keeps its identity (children, locks held on it) as the lower half.
        """
        cut = pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < pages < len(node.value)
        top = RadixNode(node.key[:cut], node.value[:pages], parent, node.depth - len(node.key) + cut)
        top.lock_ref, top.last_access = node.lock_ref, node.last_access
        parent.children[node.key[: self.page_size]] = top
        node.key, node.value, node.parent = node.key[cut:], node.value[pages:], top
        top.children[node.key[: self.page_size]] = node
        return top

    def _walk(self, tokens: tuple[int, ...], now: int) -> tuple[RadixNode, int, list[int]]:
        """Descend along ``tokens`` (page aligned), splitting at a partial match; stamps ``now``."""
        node, i, pages = self.root, 0, []
        node.last_access = now
        while i < len(tokens):
            child = node.children.get(tokens[i : i + self.page_size])
            if child is None:
                break
            m = self._match_pages(child.key, tokens, i)
            if m < len(child.value):
                child = self._split(child, m)
            child.last_access = now
            pages.extend(child.value)
            node, i = child, i + len(child.key)
        return node, i, pages

    # -- public API ----------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> tuple[int, list[int], RadixNode]:
        """Longest cached page-aligned prefix of ``tokens``.

        Returns:
            ``(matched_len, pages, last_node)``: ``matched_len`` tokens (a multiple of ``page_size``),
            their ``matched_len // page_size`` page ids, and the node ending exactly at the match
            (the root when nothing matched; pass it to :meth:`lock`).
        """
        node, n, pages = self._walk(self._aligned(tokens), self._tick())
        return n, pages, node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Insert ``tokens`` (truncated to whole pages) with their ``pages``.

        The tree adopts ``pages[num_already_present // P : len(tokens) // P]``; the caller keeps
        ownership of the pages of the already-present part (the tree keeps its own for those).

        Returns:
            ``num_already_present``: tokens (multiple of ``P``) that were cached before.
        """
        key = self._aligned(tokens)
        n_pages = len(key) // self.page_size
        if len(pages) < n_pages:
            raise ValueError(f"pages must have at least len(tokens) // page_size = {n_pages} entries, got {len(pages)}")
        node, present, _ = self._walk(key, self._tick())
        if present < len(key):
            child = RadixNode(key[present:], list(pages[present // self.page_size : n_pages]), node, len(key))
            child.last_access = node.last_access
            node.children[child.key[: self.page_size]] = child
            self._total += len(child.value)
        return present

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``."""
        n: RadixNode | None = node
        while n is not None:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {n!r}")
            n = n.parent
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Drop up to ``num_pages`` pages from unlocked leaves, least recently used first.

        Pages are cut from the tail of a leaf (keeping the tree page granular), so exactly
        ``min(num_pages, evictable_pages())`` pages are dropped. Returns the dropped page ids; the
        caller releases them.
        """
        heap = [(n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - len(freed), len(leaf.value))
            freed.extend(leaf.value[len(leaf.value) - take :])
            self._total -= take
            if take < len(leaf.value):
                leaf.value = leaf.value[: len(leaf.value) - take]
                leaf.key = leaf.key[: len(leaf.value) * self.page_size]
                leaf.depth -= take * self.page_size
                break
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            leaf.parent = None
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def total_pages(self) -> int:
        """Pages held by the tree."""
        return self._total

    def evictable_pages(self) -> int:
        """Pages in unlocked nodes (all of them can be evicted, leaves first)."""
        return sum(len(n.value) for n in self.nodes() if n.lock_ref == 0)

    def all_pages(self) -> list[int]:
        """Every page id held by the tree (one entry per holding node)."""
        return [p for n in self.nodes() for p in n.value]

    def nodes(self) -> list[RadixNode]:
        """Every node of the tree, the root included (depth first)."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_invariants(self) -> None:
        """Structural checks; raises AssertionError on violation."""
        p, total = self.page_size, 0
        for n in self.nodes():
            total += len(n.value)
            assert len(n.key) == len(n.value) * p, n
            assert n is self.root or len(n.key) > 0, n
            for k, c in n.children.items():
                assert c.parent is n and c.key[:p] == k and len(k) == p, c
                assert c.depth == n.depth + len(c.key), c
                assert c.lock_ref <= n.lock_ref, (n, c)
                assert c.last_access <= n.last_access, (n, c)
        assert total == self._total, (total, self._total)


def shared_prefix_groups(
    token_seqs: Sequence[Sequence[int]], page_size: int, min_len: int
) -> list[tuple[int, list[int]]]:
    """Group requests of one batch by a shared page-aligned prefix (for cascade attention).

    Builds a radix tree of the batch; every node at depth ``d >= max(min_len, 1)`` with members
    (requests passing through it) is a candidate ``(d, members)``. Greedy: repeatedly pick the
    candidate maximising ``d * |unassigned members|`` (ties: longer prefix, then lower node order)
    among those with at least 2 unassigned members, and make those members a group. Each request
    joins at most one group; a group's ``prefix_len`` equals its members' page-aligned longest
    common prefix, and no two ungrouped requests share a page-aligned prefix ``>= min_len``.

    Returns:
        ``[(prefix_len, sorted request indices)]`` in selection order.
    """
    tree = RadixCache(page_size)
    for s in token_seqs:
        tree.insert(s, [0] * (len(s) // page_size))
    members: dict[int, tuple[RadixNode, list[int]]] = {}
    for i, s in enumerate(token_seqs):
        _, _, node = tree.match_prefix(s)
        while node is not tree.root:
            members.setdefault(id(node), (node, []))[1].append(i)
            node = node.parent
    cands = [(n.depth, idx) for n, idx in members.values() if n.depth >= max(min_len, 1) and len(idx) >= 2]
    assigned: set[int] = set()
    groups: list[tuple[int, list[int]]] = []
    while True:
        best: tuple[int, list[int]] | None = None
        for depth, idx in cands:
            free = [i for i in idx if i not in assigned]
            if len(free) >= 2 and (best is None or (depth * len(free), depth) > (best[0] * len(best[1]), best[0])):
                best = (depth, free)
        if best is None:
            return groups
        groups.append((best[0], sorted(best[1])))
        assigned.update(best[1])
