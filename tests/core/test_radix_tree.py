"""Radix tree vs a brute-force prefix oracle; locking, LRU eviction, batch prefix groups."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from attnplug.core.radix_tree import RadixCache, shared_prefix_groups


def page_variants(p: int) -> list[list[int]]:
    """Three page contents; the first two differ only in the last token (partial-page mismatch)."""
    return [[0] * p, [0] * (p - 1) + [1], [2] * p]


@st.composite
def token_seqs(draw, p: int, max_pages: int = 4):
    pages = draw(st.lists(st.integers(0, 2), max_size=max_pages))
    tail = draw(st.lists(st.integers(0, 2), max_size=p - 1))
    return [t for c in pages for t in page_variants(p)[c]] + tail


def aligned_lcp(a, b, p: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n - n % p


class RadixMachine(RuleBasedStateMachine):
    """Oracle: ``cached`` maps every cached page-aligned prefix to the page holding its last page."""

    @initialize(p=st.sampled_from([1, 2, 4, 16]))
    def setup(self, p):
        self.p = p
        self.tree = RadixCache(p)
        self.cached: dict[tuple, int] = {}
        self.next_page = itertools.count()
        self.locks: list[tuple[object, list[int]]] = []

    def oracle_match(self, tokens):
        pages, j = [], self.p
        while j <= len(tokens) and tuple(tokens[:j]) in self.cached:
            pages.append(self.cached[tuple(tokens[:j])])
            j += self.p
        return len(pages) * self.p, pages

    @rule(data=st.data())
    def insert(self, data):
        tokens = data.draw(token_seqs(self.p))
        n_pages = len(tokens) // self.p
        pages = [next(self.next_page) for _ in range(n_pages)]
        want, _ = self.oracle_match(tokens)
        assert self.tree.insert(tokens, pages) == want
        for j in range(want // self.p, n_pages):
            self.cached[tuple(tokens[: (j + 1) * self.p])] = pages[j]

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock):
        tokens = data.draw(token_seqs(self.p))
        n, pages, node = self.tree.match_prefix(tokens)
        assert (n, pages) == self.oracle_match(tokens)
        assert node.depth == n
        if lock:
            self.tree.lock(node)
            self.locks.append((node, pages))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.tree.unlock(node)

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        protected = {pg for _, pages in self.locks for pg in pages}
        before = self.tree.evictable_pages()
        assert before == len(self.cached) - len(protected)
        freed = self.tree.evict(n)
        assert len(freed) == len(set(freed)) == min(n, before)
        assert not set(freed) & protected, "evicted a locked page"
        by_page = {pg: k for k, pg in self.cached.items()}
        for pg in freed:
            del self.cached[by_page[pg]]  # KeyError = reported a page it did not hold
        for k in self.cached:  # only leaf tails were cut: the oracle stays prefix closed
            assert len(k) == self.p or k[: -self.p] in self.cached

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        self.tree.check_invariants()
        assert self.tree.total_pages() == len(self.cached)
        assert sorted(self.tree.all_pages()) == sorted(self.cached.values())


RadixMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestRadixMachine = RadixMachine.TestCase


def test_split_and_partial_page_mismatch():
    t = RadixCache(4)
    assert t.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11]) == 0  # trailing partial page ignored
    assert t.total_pages() == 2
    n, pages, node = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 0])  # 2nd page differs in last token
    assert (n, pages, node.depth) == (4, [10], 4)
    assert t.insert([1, 2, 3, 4, 0, 0, 0, 0], [20, 21]) == 4
    assert sorted(t.all_pages()) == [10, 11, 21] and len(t.root.children) == 1
    assert t.match_prefix([1, 2, 3])[0] == 0
    with pytest.raises(ValueError, match="pages"):
        t.insert([1] * 8, [1])


def test_plain_token_tree_page_size_1():
    t = RadixCache(1)
    t.insert([5, 6, 7], [0, 1, 2])
    t.insert([5, 6, 8, 9], [3, 4, 5, 6])
    assert t.match_prefix([5, 6, 8, 1]) == (3, [0, 1, 5], t.match_prefix([5, 6, 8])[2])
    assert t.total_pages() == 5


def test_lru_eviction_order_and_locks():
    t = RadixCache(2)
    t.insert([1, 1, 2, 2], [0, 1])
    t.insert([3, 3, 4, 4], [2, 3])
    t.insert([5, 5], [4])
    t.match_prefix([1, 1, 2, 2])  # [1,1,2,2] most recently used; [3,3,4,4] least
    assert t.evict(1) == [3]  # tail page of the LRU leaf
    assert t.evict(2) == [2, 4]
    _, _, node = t.match_prefix([1, 1, 2, 2])
    t.lock(node)
    assert t.evictable_pages() == 0 and t.evict(5) == []
    t.unlock(node)
    assert t.evictable_pages() == 2 and sorted(t.evict(5)) == [0, 1] and t.total_pages() == 0
    with pytest.raises(RuntimeError, match="unlock"):
        t.unlock(node)


def test_lock_survives_split():
    t = RadixCache(1)
    t.insert([1, 2, 3], [0, 1, 2])
    _, _, node = t.match_prefix([1, 2, 3])
    t.lock(node)
    t.match_prefix([1, 9])  # splits the locked node
    t.check_invariants()
    assert t.evictable_pages() == 0
    t.unlock(node)
    assert t.evictable_pages() == 3


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(0, 10), st.data())
def test_shared_prefix_groups_properties(p, min_len, data):
    seqs = data.draw(st.lists(token_seqs(p, max_pages=4), max_size=8))
    groups = shared_prefix_groups(seqs, p, min_len)
    seen: set[int] = set()
    for plen, idx in groups:
        assert len(idx) >= 2 and not seen & set(idx) and idx == sorted(idx)
        seen |= set(idx)
        assert plen % p == 0 and plen >= max(min_len, 1)
        assert plen == min(aligned_lcp(seqs[idx[0]], seqs[i], p) for i in idx[1:])
    rest = [i for i in range(len(seqs)) if i not in seen]
    for a, b in itertools.combinations(rest, 2):
        assert aligned_lcp(seqs[a], seqs[b], p) < max(min_len, 1), "two ungrouped requests share a long prefix"


def test_shared_prefix_groups_greedy_choice():
    sys_prompt = list(range(100, 132))  # 32 tokens
    seqs = [sys_prompt + [i] * 8 for i in range(4)] + [sys_prompt + [9] * 40, sys_prompt + [9] * 40 + [1], [7] * 16]
    # 6 requests x 32 tokens (192) beats 2 requests x 72 tokens (144)
    assert shared_prefix_groups(seqs, 8, 16) == [(32, [0, 1, 2, 3, 4, 5])]
    # with a much longer private prefix the pair wins first, the other four still group
    seqs[4] = seqs[5] = sys_prompt + [9] * 200
    assert shared_prefix_groups(seqs, 8, 16) == [(232, [4, 5]), (32, [0, 1, 2, 3])]
    assert shared_prefix_groups(seqs, 8, 33) == [(232, [4, 5])]
