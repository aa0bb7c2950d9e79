"""Multi-step draft metadata and tree-verify masks against brute-force constructions (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from batches import dense_rows, draft_case, draft_rows, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention, UnsupportedFeature
from attnplug.core.draft import MultiStepDraftPlanner, build_tree_verify_mask
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cfg(page, hq=4, hkv=2, d=32, dtype=torch.bfloat16, layout="NHD"):
    return AttentionConfig(hq, hkv, d, page, dtype, kv_layout=layout)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    page=st.sampled_from([1, 16]),
    topk=st.sampled_from([1, 2, 4]),
    steps=st.integers(1, 3),
)
def test_step_metadata_equals_brute_force(data, page, topk, steps):
    seq_lens = data.draw(st.lists(st.integers(0, 45), min_size=1, max_size=4))
    seed = data.draw(st.integers(0, 2**31 - 1))
    ind, idx, last, draft, num_pages = draft_case(seq_lens, page, topk, steps, seed)
    pl = MultiStepDraftPlanner(
        cfg(page), topk, steps, max_batch=4, provider="reference", device="cpu", max_prefix_tokens=200
    )
    plans = pl.plan(ind, idx, last, draft, num_pages=num_pages)
    assert len(plans) == steps
    lo, hi = pl._buf.data_ptr(), pl._buf.data_ptr() + pl._buf.numel() * 4
    for i, p in enumerate(plans):
        exp = draft_rows(ind, idx, seq_lens, draft, page, i)
        R = len(seq_lens) * topk
        assert p.batch_size == R and p.config.page_size == 1
        assert p.kv_lens_cpu.tolist() == [len(r) for r in exp]
        assert p.qo_indptr_cpu.tolist() == list(range(R + 1))
        got = [p.kv_indices_cpu[int(p.kv_indptr_cpu[r]) : int(p.kv_indptr_cpu[r + 1])].tolist() for r in range(R)]
        assert got == exp, f"step {i}"
        # the device tensors hold the same (one shared buffer, one copy)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"):
            d, h = getattr(p, name), getattr(p, name + "_cpu")
            assert torch.equal(d.cpu(), h), name
            assert lo <= d.data_ptr() < hi or d.numel() == 0, f"{name} outside the shared buffer"


@pytest.mark.parametrize("page,topk,steps,splits", [(16, 2, 3, 1), (1, 4, 2, 2), (16, 1, 2, 3)])
def test_draft_attention_equals_dense(page, topk, steps, splits):
    seq_lens = [37, 0, 16]
    ind, idx, last, draft, num_pages = draft_case(seq_lens, page, topk, steps, seed=page + topk)
    c = cfg(page)
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(c.dtype)
    v_cache = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(c.dtype)
    pl = MultiStepDraftPlanner(c, topk, steps, max_batch=3, provider="triton", device=DEVICE, num_kv_splits=splits)
    pl.plan(ind, idx, last, draft, num_pages=num_pages)
    R = len(seq_lens) * topk
    for i in range(steps):
        q = torch.randn(R, c.num_qo_heads, c.head_dim, generator=g).to(c.dtype)
        out = torch.full_like(q, math.nan).to(DEVICE)
        pl.run(i, q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), out)
        ref = dense_rows(q, k_cache, v_cache, draft_rows(ind, idx, seq_lens, draft, page, i), c)
        assert rel_err(out.cpu(), ref) < 1e-2, f"step {i}"


def test_draft_refusals():
    with pytest.raises(UnsupportedFeature, match="HND"):
        MultiStepDraftPlanner(cfg(16, layout="HND"), 2, 2, 2, provider="reference", device="cpu")
    pl = MultiStepDraftPlanner(cfg(16), 2, 2, 2, provider="reference", device="cpu", max_prefix_tokens=8)
    ind, idx, last, draft, n = draft_case([5, 7], 16, 2, 2, 0)
    with pytest.raises(ValueError, match="draft_slots"):
        pl.plan(ind, idx, last, draft[:, :1], num_pages=n)
    ind2, idx2, last2, draft2, n2 = draft_case([40, 40], 16, 2, 2, 0)
    with pytest.raises(ValueError, match="max_prefix_tokens"):
        pl.plan(ind2, idx2, last2, draft2, num_pages=n2)


# ---- tree verify -------------------------------------------------------------------------------
def random_parents(B, n, g):
    return torch.stack(
        [torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]) for _ in range(B)]
    )


def ancestors(par, i):
    out = {i}
    while par[i] >= 0:
        i = par[i]
        out.add(i)
    return out


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 4), n=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_tree_mask_equals_ancestor_walk(B, n, seed):
    g = torch.Generator().manual_seed(seed)
    par = random_parents(B, n, g)
    prefix = torch.randint(0, 20, (B,), generator=g)
    m = build_tree_verify_mask(par, prefix)
    off = 0
    for b in range(B):
        pl = int(prefix[b])
        blk = m[off : off + n * (pl + n)].view(n, pl + n)
        off += n * (pl + n)
        assert blk[:, :pl].all()
        for i in range(n):
            anc = ancestors(par[b].tolist(), i)
            assert [bool(x) for x in blk[i, pl:]] == [c in anc for c in range(n)]
    assert off == m.numel()


def test_tree_mask_rejects_bad_parents():
    with pytest.raises(ValueError, match="parents"):
        build_tree_verify_mask(torch.tensor([[-1, 1]]), torch.tensor([3]))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_verify_attention(page, seed):
    """Core triton provider with build_tree_verify_mask == reference == dense over prefix + ancestors."""
    g = torch.Generator().manual_seed(seed)
    c = cfg(page, hq=8, hkv=2)
    B, n = 3, 6
    prefix = torch.tensor([21, 0, 40])
    par = random_parents(B, n, g)
    kv = (prefix + n).tolist()
    npg = [-(-x // page) for x in kv]
    num_pages = sum(npg) + 3
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    ind = torch.tensor([0] + npg).cumsum(0).to(torch.int32)
    last = torch.tensor([(x - 1) % page + 1 for x in kv], dtype=torch.int32)
    batch = BatchMetadata(
        ForwardMode.TARGET_VERIFY,
        (torch.arange(B + 1) * n).to(torch.int32),
        ind,
        perm[: sum(npg)].clone(),
        last,
        custom_mask=build_tree_verify_mask(par, prefix),
    )
    k_cache = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(c.dtype)
    v_cache = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(c.dtype)
    q = torch.randn(B * n, c.num_qo_heads, c.head_dim, generator=g).to(c.dtype)
    attn = PagedAttention(c, "triton", DEVICE)
    plan = attn.plan(batch, num_pages=num_pages)
    out = attn.run(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE))
    ref, _ = reference_attention(plan, q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE))
    assert rel_err(out, ref) < 1e-2
    # dense, straight from the parent pointers (no mask involved)
    rows = []
    for b in range(B):
        pages = batch.kv_indices[int(ind[b]) : int(ind[b + 1])].tolist()
        slot = lambda t, pages=pages: pages[t // page] * page + t % page  # noqa: E731
        pl = int(prefix[b])
        for i in range(n):
            rows.append([slot(t) for t in range(pl)] + [slot(pl + a) for a in sorted(ancestors(par[b].tolist(), i))])
    dense = dense_rows(q, k_cache, v_cache, rows, c)
    assert rel_err(out.cpu(), dense) < 1e-2
