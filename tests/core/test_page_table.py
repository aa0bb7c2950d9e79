"""Page-table dialect converters: exact round trips on random ragged batches, bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.core.page_table import (
    block_table_from_csr,
    csr_from_block_table,
    csr_from_req_to_token,
    req_to_token_from_csr,
    seq_lens_from_csr,
    slot_mapping,
    slot_mapping_from_csr,
)

I32 = torch.int32
PAGE_SIZES = [1, 16, 256]


@st.composite
def batches(draw):
    """Random ragged batch: page size, per-request lengths (incl. 0 and exact page multiples), pages."""
    p = draw(st.sampled_from(PAGE_SIZES))
    n = draw(st.integers(0, 6))
    lens = [
        draw(st.one_of(st.just(0), st.integers(1, 3).map(lambda k: k * p), st.integers(0, 3 * p + 5))) for _ in range(n)
    ]
    counts = [-(-L // p) for L in lens]
    pool = draw(st.permutations(range(sum(counts) + draw(st.integers(0, 5)))))
    pages, i = [], 0
    for c in counts:
        pages.append(list(pool[i : i + c]))
        i += c
    return p, lens, pages


def ref_csr(p, lens, pages):
    indptr = [0]
    for pg in pages:
        indptr.append(indptr[-1] + len(pg))
    last = [(L - 1) % p + 1 if L else 0 for L in lens]
    return (
        torch.tensor(indptr, dtype=I32),
        torch.tensor([x for pg in pages for x in pg], dtype=I32),
        torch.tensor(last, dtype=I32),
    )


def eq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 3), st.integers(-7, 7))
def test_block_table_round_trip(batch, extra_cols, pad):
    p, lens, pages = batch
    indptr, indices, last = ref_csr(p, lens, pages)
    maxp = max((len(x) for x in pages), default=0) + extra_cols
    bt = torch.full((len(lens), maxp), pad, dtype=I32)  # padding is arbitrary and must be ignored
    for b, pg in enumerate(pages):
        bt[b, : len(pg)] = torch.tensor(pg, dtype=I32)
    seq = torch.tensor(lens, dtype=I32)
    got = csr_from_block_table(bt, seq, p)
    assert all(eq(g, r) for g, r in zip(got, (indptr, indices, last)))
    bt2, seq2 = block_table_from_csr(*got, p, max_pages=maxp)
    assert eq(seq2, seq)
    for b, pg in enumerate(pages):
        assert bt2[b, : len(pg)].tolist() == pg
    assert all(eq(g, r) for g, r in zip(csr_from_block_table(bt2, seq2, p), got))
    assert eq(seq_lens_from_csr(indptr, last, p), seq)
    bt3, _ = block_table_from_csr(indptr, indices, last, p)  # default width = longest request
    assert bt3.shape == (len(lens), max((len(x) for x in pages), default=0))


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_req_to_token_round_trip(batch, data):
    p, lens, pages = batch
    indptr, indices, last = ref_csr(p, lens, pages)
    n_slots = len(lens) + data.draw(st.integers(0, 3))
    rows = data.draw(st.permutations(range(n_slots)))[: len(lens)]
    max_ctx = max(lens, default=0) + data.draw(st.integers(0, 4))
    r2t = torch.full((n_slots, max_ctx), -1, dtype=I32)
    for b, (L, pg) in enumerate(zip(lens, pages)):
        r2t[rows[b], :L] = torch.tensor([pg[t // p] * p + t % p for t in range(L)], dtype=I32)
    pool_idx = torch.tensor(rows, dtype=torch.int64)
    seq = torch.tensor(lens, dtype=I32)
    got = csr_from_req_to_token(r2t, pool_idx, seq, p)
    assert all(eq(g, r) for g, r in zip(got, (indptr, indices, last)))
    r2t2, pool2, seq2 = req_to_token_from_csr(*got, p, num_req_slots=n_slots, max_ctx=max_ctx)
    assert r2t2.shape == (n_slots, max_ctx) and eq(seq2, seq) and pool2.tolist() == list(range(len(lens)))
    for b, L in enumerate(lens):
        assert torch.equal(r2t2[b, :L], r2t[rows[b], :L])
    assert all(eq(g, r) for g, r in zip(csr_from_req_to_token(r2t2, pool2, seq2, p), got))


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_slot_mapping_matches_reference(batch, data):
    p, lens, pages = batch
    indptr, indices, last = ref_csr(p, lens, pages)
    toks = [(b, t) for b, L in enumerate(lens) for t in range(L)]
    toks = data.draw(st.lists(st.sampled_from(toks), max_size=40)) if toks else []
    req = torch.tensor([b for b, _ in toks], dtype=torch.int64)
    pos = torch.tensor([t for _, t in toks], dtype=I32)
    want = torch.tensor([pages[b][t // p] * p + t % p for b, t in toks], dtype=I32)
    bt, _ = block_table_from_csr(indptr, indices, last, p)
    assert eq(slot_mapping(bt, pos, req, p), want)
    assert eq(slot_mapping_from_csr(indptr, indices, p, req, pos), want)


def test_known_example():
    # P=4: req0 = 6 tokens on pages [7, 2], req1 = 0 tokens, req2 = 4 tokens on page [5]
    bt = torch.tensor([[7, 2], [0, 0], [5, 9]], dtype=I32)
    seq = torch.tensor([6, 0, 4], dtype=I32)
    indptr, indices, last = csr_from_block_table(bt, seq, 4)
    assert indptr.tolist() == [0, 2, 2, 3] and indices.tolist() == [7, 2, 5] and last.tolist() == [2, 0, 4]
    r2t, _, _ = req_to_token_from_csr(indptr, indices, last, 4)
    assert r2t[0].tolist() == [28, 29, 30, 31, 8, 9] and r2t[2, :4].tolist() == [20, 21, 22, 23]
    sm = slot_mapping(bt, torch.tensor([5, 3]), torch.tensor([0, 2]), 4)
    assert sm.tolist() == [9, 23]


def test_unaligned_req_to_token_rejected():
    p = 4
    r2t = torch.tensor([[8, 9, 10, 11, 4, 5]], dtype=I32)
    seq, idx = torch.tensor([6], dtype=I32), torch.tensor([0], dtype=I32)
    assert csr_from_req_to_token(r2t, idx, seq, p)[1].tolist() == [2, 1]
    for bad in ([9, 8, 10, 11, 4, 5], [8, 9, 10, 11, 5, 6], [8, 9, 14, 15, 4, 5], [9, 10, 11, 12, 4, 5]):
        with pytest.raises(ValueError, match="page aligned"):
            csr_from_req_to_token(torch.tensor([bad], dtype=I32), idx, seq, p)
    # P=1: any slots are fine (each token its own page)
    assert csr_from_req_to_token(torch.tensor([[5, 3, 9]], dtype=I32), idx, torch.tensor([3]), 1)[1].tolist() == [
        5,
        3,
        9,
    ]


def _t(*x, dtype=I32):
    return torch.tensor(list(x), dtype=dtype)


BT, SEQ = torch.tensor([[1, 2], [3, 4]], dtype=I32), _t(5, 3)
CSR = (_t(0, 2, 3), _t(1, 2, 3), _t(1, 3))

BAD = [
    ("block_table", lambda: csr_from_block_table(BT.long(), SEQ, 4)),
    ("block_table", lambda: csr_from_block_table(BT[0], SEQ, 4)),
    ("seq_lens", lambda: csr_from_block_table(BT, _t(5), 4)),
    ("seq_lens", lambda: csr_from_block_table(BT, _t(5, -1), 4)),
    ("max_pages", lambda: csr_from_block_table(BT, _t(9, 3), 4)),
    ("block_table", lambda: csr_from_block_table(torch.tensor([[1, -2], [3, 4]], dtype=I32), SEQ, 4)),
    ("page_size", lambda: csr_from_block_table(BT, SEQ, 0)),
    ("kv_indptr", lambda: block_table_from_csr(CSR[0].long(), CSR[1], CSR[2], 4)),
    ("kv_indptr", lambda: block_table_from_csr(_t(0, 2, 4), CSR[1], CSR[2], 4)),
    ("kv_indptr", lambda: block_table_from_csr(_t(1, 2, 3), CSR[1], CSR[2], 4)),
    ("kv_indptr", lambda: block_table_from_csr(_t(0, 3, 2), CSR[1], CSR[2], 4)),
    ("kv_indices", lambda: block_table_from_csr(CSR[0], _t(1, -2, 3), CSR[2], 4)),
    ("kv_indices", lambda: block_table_from_csr(CSR[0], CSR[1].view(1, 3), CSR[2], 4)),
    ("kv_last_page_len", lambda: block_table_from_csr(CSR[0], CSR[1], _t(1), 4)),
    ("kv_last_page_len", lambda: block_table_from_csr(CSR[0], CSR[1], _t(0, 3), 4)),
    ("kv_last_page_len", lambda: block_table_from_csr(CSR[0], CSR[1], _t(1, 5), 4)),
    ("kv_last_page_len", lambda: block_table_from_csr(_t(0, 0), _t(), _t(2), 4)),
    ("max_pages", lambda: block_table_from_csr(*CSR, 4, max_pages=1)),
    ("max_ctx", lambda: req_to_token_from_csr(*CSR, 4, max_ctx=4)),
    ("num_req_slots", lambda: req_to_token_from_csr(*CSR, 4, num_req_slots=1)),
    ("req_to_token", lambda: csr_from_req_to_token(torch.zeros(2, 8), _t(0, 1), SEQ, 4)),
    ("req_pool_indices", lambda: csr_from_req_to_token(torch.zeros(2, 8, dtype=I32), _t(0, 2), SEQ, 4)),
    ("req_pool_indices", lambda: csr_from_req_to_token(torch.zeros(2, 8, dtype=I32), _t(0, -1), SEQ, 4)),
    ("seq_lens", lambda: csr_from_req_to_token(torch.zeros(2, 8, dtype=I32), _t(0, 1), _t(9, 1), 4)),
    ("seq_lens", lambda: csr_from_req_to_token(torch.zeros(2, 8, dtype=I32), _t(0, 1), _t(1), 4)),
    ("req_to_token", lambda: csr_from_req_to_token(torch.full((2, 8), -4, dtype=I32), _t(0, 1), SEQ, 4)),
    ("positions", lambda: slot_mapping(BT, _t(0, -1), _t(0, 1), 4)),
    ("positions", lambda: slot_mapping(BT, _t(8), _t(0), 4)),
    ("positions", lambda: slot_mapping(BT, _t(0, 1).float(), _t(0, 1), 4)),
    ("req_ids", lambda: slot_mapping(BT, _t(0, 1), _t(0, 2), 4)),
    ("req_ids", lambda: slot_mapping(BT, _t(0, 1), _t(0), 4)),
    ("positions", lambda: slot_mapping_from_csr(*CSR[:2], 4, _t(1), _t(4))),
    ("req_ids", lambda: slot_mapping_from_csr(*CSR[:2], 4, _t(2), _t(0))),
    ("kv_indices", lambda: slot_mapping_from_csr(CSR[0], CSR[1].long(), 4, _t(0), _t(0))),
]


@pytest.mark.parametrize("name,fn", BAD, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD)])
def test_bad_input_raises(name, fn):
    with pytest.raises(ValueError, match=name):
        fn()
