"""Paged-KV manager: allocator, fork/COW, prefix reuse; a stateful model with simulated KV contents."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from attnplug.core.kv_layout import KVLayout, allocate_kv_cache, to_nhd, write_kv
from attnplug.core.page_table import block_table_from_csr, slot_mapping_from_csr
from attnplug.core.paged_kv import OutOfPages, PageAllocator, PagedKVManager, apply_page_copies


def kv_value(token: int, pos: int) -> float:
    """Simulated K of ``token`` at ``pos`` (V is its negation); unique per (token, position)."""
    return float(token * 1000 + pos + 1)


@st.composite
def token_seqs(draw, p: int, max_pages: int = 3):
    """Tokens built from 3 page contents (two differ only in their last token) + a partial tail."""
    variants = [[0] * p, [0] * (p - 1) + [1], [2] * p]
    pages = draw(st.lists(st.integers(0, 2), max_size=max_pages))
    tail = draw(st.lists(st.integers(0, 2), max_size=p - 1))
    return [t for c in pages for t in variants[c]] + tail


class KVSim:
    """Paged K/V tensors ``[num_pages, P, 1, 1]`` in ``layout`` with helpers to write/read tokens."""

    def __init__(self, mgr: PagedKVManager, layout: KVLayout) -> None:
        self.mgr, self.layout = mgr, layout
        self.k, self.v = allocate_kv_cache(mgr.allocator.num_pages, mgr.page_size, 1, 1, layout, torch.float32)

    def write(self, rid, tokens: list[int], start: int) -> None:
        pos = list(range(start, start + len(tokens)))
        slots = self.mgr.slot_mapping([rid] * len(pos), pos)
        k = torch.tensor([kv_value(t, i) for t, i in zip(tokens, pos)]).view(-1, 1, 1)
        write_kv(k, -k, self.k, self.v, slots, self.layout)

    def read_pages(self, pages: list[int], n: int) -> list[float]:
        kn, vn = to_nhd(self.k, self.layout), to_nhd(self.v, self.layout)
        idx = torch.tensor(pages, dtype=torch.long)
        k, v = kn[idx].reshape(-1)[:n], vn[idx].reshape(-1)[:n]
        assert torch.equal(v, -k)
        return k.tolist()

    def read(self, rid) -> list[float]:
        n = self.mgr.seq_len(rid)
        slots = self.mgr.slot_mapping([rid] * n, list(range(n))).long()
        assert slots.tolist() == [
            self.mgr.page_table(rid)[i // self.mgr.page_size] * self.mgr.page_size + i % self.mgr.page_size
            for i in range(n)
        ]
        return to_nhd(self.k, self.layout).reshape(-1)[slots].tolist() if n else []


class ManagerMachine(RuleBasedStateMachine):
    """Random add/extend/fork/cache/free sequences; every request must keep seeing its own tokens."""

    @initialize(
        p=st.sampled_from([1, 4, 16]),
        layout=st.sampled_from(list(KVLayout)),
        prefix=st.sampled_from([True, True, False]),
    )
    def setup(self, p, layout, prefix):
        self.p = p
        self.mgr = PagedKVManager(14, p, enable_prefix_cache=prefix)
        self.kv = KVSim(self.mgr, layout)
        self.tokens: dict[int, list[int]] = {}
        self.ids = itertools.count()
        self.history: list[list[int]] = []

    def rid(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @rule(data=st.data(), by_ids=st.booleans())
    def add(self, data, by_ids):
        toks = data.draw(token_seqs(self.p))
        if self.history and data.draw(st.integers(0, 2)):  # share a prefix with a cached request
            base = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
            toks = base[:cut] + toks[: 2 * self.p]
        rid = next(self.ids)
        try:
            matched = self.mgr.add_request(rid, toks if by_ids else len(toks))
        except OutOfPages:
            event("add: out of pages")
            assert rid not in self.mgr.requests
            return
        if matched:
            event("add: prefix hit")
        assert matched % self.p == 0 and (matched == 0 or matched < len(toks))
        assert not by_ids or self.mgr.radix_cache is not None or matched == 0
        # reused prefix pages must already hold exactly this prefix's KV
        assert self.kv.read_pages(self.mgr.page_table(rid), matched) == [
            kv_value(t, i) for i, t in enumerate(toks[:matched])
        ]
        self.kv.write(rid, toks[matched:], matched)
        self.tokens[rid] = toks

    @rule(data=st.data())
    def extend(self, data):
        if not self.tokens:
            return
        rid = self.rid(data)
        new = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=2 * self.p + 1))
        before = self.mgr.page_table(rid)
        try:
            pages = self.mgr.extend(rid, len(new))
        except OutOfPages:
            event("extend: out of pages")
            assert self.mgr.page_table(rid) == before and self.mgr.seq_len(rid) == len(self.tokens[rid])
            return
        assert self.mgr.page_table(rid) == before + pages
        self.kv.write(rid, new, len(self.tokens[rid]))
        self.tokens[rid] = self.tokens[rid] + new

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        src, dst = self.rid(data), next(self.ids)
        try:
            copies = self.mgr.fork(src, dst)
        except OutOfPages:
            assert dst not in self.mgr.requests
            return
        n = len(self.tokens[src])
        assert len(copies) == (1 if n % self.p else 0)
        event(f"fork: {len(copies)} copies")
        sp, dp = self.mgr.page_table(src), self.mgr.page_table(dst)
        assert sp[: n // self.p] == dp[: n // self.p] and (not copies or copies == [(sp[-1], dp[-1])])
        apply_page_copies(self.kv.k, self.kv.v, copies, self.kv.layout)
        self.tokens[dst] = list(self.tokens[src])

    def _cache(self, rid) -> None:
        toks = self.tokens[rid]
        present = self.mgr.cache_request(rid, toks)
        self.history.append(toks)
        event(f"cache_request: already present {present > 0}")
        assert present % self.p == 0 and present <= len(toks)
        assert self.mgr.radix_cache.match_prefix(toks)[0] == len(toks) - len(toks) % self.p

    @rule(data=st.data())
    def cache(self, data):
        if self.tokens and self.mgr.radix_cache is not None:
            self._cache(self.rid(data))

    @rule(data=st.data(), cache_first=st.booleans())
    def free(self, data, cache_first):
        if not self.tokens:
            return
        rid = self.rid(data)
        if cache_first and self.mgr.radix_cache is not None:
            self._cache(rid)
        before = self.mgr.num_free_pages
        freed = self.mgr.free_request(rid)
        assert self.mgr.num_free_pages == before + len(freed)
        del self.tokens[rid]
        with pytest.raises(KeyError):
            self.mgr.seq_len(rid)

    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        assert sorted(self.mgr.requests) == sorted(self.tokens)
        for rid, toks in self.tokens.items():
            assert self.mgr.seq_len(rid) == len(toks)
            assert self.kv.read(rid) == [kv_value(t, i) for i, t in enumerate(toks)], f"request {rid} lost its KV"
        tree = self.mgr.radix_cache
        if tree is not None:  # every cached page still holds the KV of its tree prefix
            for node in tree.nodes():
                chain, n = [], node
                while n is not None:
                    chain.append(n)
                    n = n.parent
                toks = [t for c in reversed(chain) for t in c.key]
                pages = [pg for c in reversed(chain) for pg in c.value]
                assert self.kv.read_pages(pages, len(toks)) == [kv_value(t, i) for i, t in enumerate(toks)]


ManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


def test_allocator():
    a = PageAllocator(4)
    assert a.alloc(0) == [] and a.num_free == 4
    pages = a.alloc(3)
    assert len(set(pages)) == 3 and a.num_free == 1
    with pytest.raises(OutOfPages, match="requested 2 pages but only 1 of 4"):
        a.alloc(2)
    assert issubclass(OutOfPages, RuntimeError) and a.num_free == 1
    a.incref(pages[0])
    assert a.decref(pages[0]) is False and a.decref(pages[0]) is True and a.num_free == 2
    with pytest.raises(RuntimeError, match="not allocated"):
        a.decref(pages[0])
    with pytest.raises(RuntimeError, match="not allocated"):
        a.incref(pages[0])
    with pytest.raises(ValueError, match="page must be in"):
        a.incref(7)
    assert a.free(pages[1:]) == pages[1:] and a.num_free == 4


@pytest.mark.parametrize("n,copies", [(8, 0), (9, 1), (0, 0)])
def test_fork_shares_full_pages_and_copies_partial(n, copies):
    m = PagedKVManager(8, 4)
    m.add_request("a", n)
    out = m.fork("a", "b")
    pa, pb = m.page_table("a"), m.page_table("b")
    assert len(out) == copies and m.seq_len("b") == n
    assert pa[: n // 4] == pb[: n // 4] and all(m.allocator.refcount[p] == 2 for p in pa[: n // 4])
    if copies:
        assert out == [(pa[-1], pb[-1])] and pa[-1] != pb[-1] and m.allocator.refcount[pb[-1]] == 1
    m.check_invariants()
    m.extend("a", 3)
    m.extend("b", 5)
    assert set(m.page_table("a")[n // 4 :]).isdisjoint(m.page_table("b")[n // 4 :])
    m.free_request("a")
    m.free_request("b")
    assert m.num_free_pages == 8
    m.check_invariants()


def test_check_invariants_detects_corruption():
    m = PagedKVManager(6, 2)
    m.add_request("a", 3)
    m.check_invariants()
    m.allocator.refcount[m.page_table("a")[0]] += 1  # leaked reference
    with pytest.raises(AssertionError, match="refcount"):
        m.check_invariants()
    m.allocator.refcount[m.page_table("a")[0]] -= 1
    m.allocator._free.append(m.page_table("a")[1])  # page both owned and free
    with pytest.raises(AssertionError, match="free list"):
        m.check_invariants()
    m.allocator._free.pop()
    m._reqs["a"].num_tokens = 5  # page table too short
    with pytest.raises(AssertionError, match="pages for"):
        m.check_invariants()


def test_prefix_reuse_and_match_last():
    m = PagedKVManager(16, 4, enable_prefix_cache=True)
    toks = list(range(10))
    assert m.add_request("a", toks) == 0
    assert m.cache_request("a", toks) == 0 and m.radix_cache.total_pages() == 2
    pa = m.page_table("a")
    m.free_request("a")
    m.check_invariants()
    assert m.num_free_pages == 14  # the tree keeps the 2 full pages
    assert m.add_request("b", toks) == 8 and m.page_table("b")[:2] == pa[:2]
    assert m.add_request("c", toks[:8]) == 4  # keeps the last token to compute
    assert m.add_request("d", toks[:8], match_last=True) == 8
    assert m.add_request("e", [0, 1, 2, 3, 9, 9]) == 4
    assert m.radix_cache.evictable_pages() == 0  # all cached pages locked by live requests
    m.check_invariants()
    for r in "bcde":
        m.free_request(r)
    m.check_invariants()
    assert m.radix_cache.evictable_pages() == 2 and m.num_free_pages == 14
    m.add_request("z", 1)
    with pytest.raises(ValueError, match="already exists"):
        m.add_request("z", 1)


def test_oom_evicts_prefix_cache_and_rolls_back():
    m = PagedKVManager(4, 2, enable_prefix_cache=True)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    m.add_request("a", toks)
    m.cache_request("a", toks)
    m.free_request("a")
    assert m.num_free_pages == 0 and m.radix_cache.total_pages() == 4
    with pytest.raises(OutOfPages):  # matches 2 pages, needs 3 more: only 2 evictable -> rollback
        m.add_request("x", [1, 2, 3, 4, 0, 0, 0, 0, 0, 0])
    m.check_invariants()
    assert "x" not in m.requests and m.radix_cache.root.lock_ref == 1
    assert m.add_request("b", [9] * 5) == 0  # evicts LRU cached pages to make room
    assert m.radix_cache.total_pages() == 1 and m.num_free_pages == 0
    m.check_invariants()


def test_batch_builders_agree_with_dialects():
    m = PagedKVManager(32, 4)
    for rid, n in (("a", 9), ("b", 0), ("c", 4), ("d", 13)):
        m.add_request(rid, n)
    m.fork("a", "e")
    rids = ["d", "a", "b", "e", "c"]
    indptr, indices, last = m.csr(rids)
    bt, seq = m.block_table(rids)
    assert seq.tolist() == [13, 9, 0, 9, 4] and last.tolist() == [1, 1, 0, 1, 4]
    bt2, seq2 = block_table_from_csr(indptr, indices, last, 4)
    assert torch.equal(bt, bt2) and torch.equal(seq, seq2) and bt.dtype == torch.int32
    assert bt[1, :3].tolist() == m.page_table("a")
    pos = [12, 0, 8, 3]
    sm = m.slot_mapping(["d", "a", "e", "c"], pos)
    ref = slot_mapping_from_csr(indptr, indices, 4, torch.tensor([0, 1, 3, 4]), torch.tensor(pos))
    assert sm.dtype == torch.int32 and torch.equal(sm, ref)
    assert sm[2] != m.slot_mapping(["a"], [8])[0]  # forked partial page is private
    with pytest.raises(ValueError, match="positions"):
        m.slot_mapping(["c"], [4])
    with pytest.raises(ValueError, match="max_pages"):
        m.block_table(rids, max_pages=2)
    with pytest.raises(KeyError):
        m.csr(["zz"])
