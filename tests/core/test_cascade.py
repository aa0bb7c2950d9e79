"""Shared-prefix (cascade) attention: grouping from the page table, the cost model, and the split
plan run through providers, against the float32 reference of the whole (unsplit) batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from batches import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, make_plan
from attnplug.core.cascade import cascade_mode, cascade_pays, find_groups, plan_cascade, shareable_pages
from attnplug.core.reference import reference_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cfg(page=4, dtype=torch.bfloat16, **kw):
    return AttentionConfig(8, 2, 32, page, dtype, **kw)


def brute_groups_ok(plan, groups):
    """Every group: >= 2 members, disjoint, members' first ``pages`` page ids equal, within shareable."""
    shareable = shareable_pages(plan)
    ind, idx = plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy()
    seen = set()
    for g in groups:
        assert g.members.size >= 2 and g.pages >= 1
        assert not seen & set(g.members.tolist())
        seen |= set(g.members.tolist())
        heads = [tuple(idx[ind[b] : ind[b] + g.pages]) for b in g.members]
        assert len(set(heads)) == 1, "members must share the same leading page ids"
        assert all(shareable[b] >= g.pages for b in g.members)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=0, max_size=4),  # groups (a size-1 "group" shares nothing)
    shared=st.integers(0, 40),
    unique=st.integers(0, 9),
    nested=st.sampled_from([0, 0, 8, 13]),
    loners=st.integers(0, 3),
    page=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 1000),
)
def test_groups_share_page_ids_and_every_sharing_pair_is_grouped(sizes, shared, unique, nested, loners, page, seed):
    toks = prompts([(n, shared) for n in sizes] + [(1, 0)] * loners, unique, nested=nested, seed=seed)
    if len(toks) < 1:
        return
    c = cfg(page)
    batch, *_, num_pages = shared_prefix_batch(c, ForwardMode.DECODE, toks, seed=seed)
    plan = make_plan(c, batch, num_pages)
    groups = find_groups(plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy(), shareable_pages(plan))
    brute_groups_ok(plan, groups)
    # completeness: two requests left outside groups share no first page (else the grouping missed them)
    grouped = set(np.concatenate([g.members for g in groups]).tolist()) if groups else set()
    sh = shareable_pages(plan)
    ind, idx = plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy()
    firsts = [idx[ind[b]] for b in range(plan.batch_size) if b not in grouped and sh[b] >= 1]
    assert len(firsts) == len(set(firsts))


def test_nothing_shared_and_single_group_fast_paths():
    c = cfg(16)
    batch, *_, n = shared_prefix_batch(c, ForwardMode.DECODE, prompts([(1, 40)] * 6, 20))
    plan = make_plan(c, batch, n)
    assert find_groups(plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy(), shareable_pages(plan)) == []
    batch, *_, n = shared_prefix_batch(c, ForwardMode.DECODE, prompts([(6, 100)], 20))  # 100 tokens: 6 whole pages
    plan = make_plan(c, batch, n)
    (g,) = find_groups(plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy(), shareable_pages(plan))
    assert g.pages == 6 and g.members.tolist() == list(range(6))  # the 4-token tail (mid-page) stays private


def test_nested_prefixes_pick_the_deeper_groups():
    c = cfg(4)
    toks = prompts([(3, 40), (3, 40)], 3, nested=8)  # two groups of 3 under a common 8-token preamble
    batch, *_, n = shared_prefix_batch(c, ForwardMode.DECODE, toks)
    plan = make_plan(c, batch, n)
    groups = find_groups(plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy(), shareable_pages(plan))
    brute_groups_ok(plan, groups)
    assert sorted((g.pages, g.members.tolist()) for g in groups) == [(12, [0, 1, 2]), (12, [3, 4, 5])]


def test_cost_model_and_modes(monkeypatch):
    big = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    batch, *_, n = shared_prefix_batch(big, ForwardMode.DECODE, prompts([(64, 512)], 16), device="meta")
    plan = make_plan(big, batch, n, device="cpu")
    groups = find_groups(plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy(), shareable_pages(plan))
    assert cascade_pays(plan, groups)  # 63 x 32 pages of 64 KiB saved per layer
    small = make_plan(
        big, shared_prefix_batch(big, ForwardMode.DECODE, prompts([(2, 32)], 16), device="meta")[0], None, device="cpu"
    )
    assert not cascade_pays(
        small, find_groups(small.kv_indptr_cpu.numpy(), small.kv_indices_cpu.numpy(), shareable_pages(small))
    )
    assert plan_cascade(small, "auto") is None and plan_cascade(small, "always") is not None
    assert plan_cascade(plan, "off") is None
    monkeypatch.setenv("ATTNPLUG_CASCADE", "0")
    assert cascade_mode() == "off"
    monkeypatch.setenv("ATTNPLUG_CASCADE", "always")
    assert cascade_mode() == "always"
    monkeypatch.setenv("ATTNPLUG_CASCADE", "maybe")
    with pytest.raises(ValueError, match="ATTNPLUG_CASCADE must be 0, 1 or always"):
        cascade_mode()


def test_window_disables_sharing():
    c = cfg(4, window_left=8)
    batch, *_, n = shared_prefix_batch(c, ForwardMode.DECODE, prompts([(3, 40)], 4))
    assert plan_cascade(make_plan(c, batch, n), "always") is None


CASES = [
    # (mode, q_len, groups, unique, nested, loners)
    (ForwardMode.DECODE, 1, [(4, 37)], 5, 0, 0),  # one group, in order: no row gather
    (ForwardMode.DECODE, 1, [(3, 30), (2, 21)], 6, 0, 2),  # two groups + requests of their own
    (ForwardMode.DECODE, 1, [(2, 20), (3, 20)], 3, 12, 1),  # nested prefixes
    (ForwardMode.TARGET_VERIFY, 4, [(3, 33)], 5, 0, 1),  # tree masks apply to the suffix only
    (ForwardMode.EXTEND, 6, [(3, 25), (2, 16)], 7, 0, 0),  # causal extends over a shared prefix
]


@pytest.mark.parametrize("provider", ["triton", "reference"])
@pytest.mark.parametrize("mode, q_len, groups, unique, nested, loners", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cascade_equals_reference(provider, mode, q_len, groups, unique, nested, loners, dtype):
    c = cfg(4, dtype)
    toks = prompts(groups + [(1, 0)] * loners, unique, nested=nested, seed=q_len)
    batch, q, k, v, n = shared_prefix_batch(c, mode, toks, q_len=q_len, seed=1, device=DEV)
    attn = PagedAttention(c, provider, DEV, cascade="always")
    plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None and plan.cascade.shared_tokens > 0
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], c.num_qo_heads), math.nan, device=DEV)
    attn.run(q, k, v, out=out, lse=lse)
    whole = make_plan(c, batch, n, device=DEV)
    ref, ref_lse = reference_attention(whole, q, k, v)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b in range(whole.batch_size):  # per request: one wrong row must not hide in the total
        lo, hi = int(whole.qo_indptr_cpu[b]), int(whole.qo_indptr_cpu[b + 1])
        assert rel_err(out[lo:hi], ref[lo:hi]) <= tol, (b, rel_err(out[lo:hi], ref[lo:hi]))
    assert rel_err(lse, ref_lse) <= (1e-5 if dtype == torch.float32 else 1e-3)
    # the same attention object without sharing: the plan runs whole
    attn_off = PagedAttention(c, provider, DEV, cascade="off")
    assert attn_off.plan(batch, num_pages=n).cascade is None


def test_suffix_and_prefix_plans_partition_every_requests_keys():
    """The two parts read disjoint keys that together are each request's KV (by page id)."""
    c = cfg(4)
    toks = prompts([(3, 30), (2, 21)] + [(1, 0)], 6)
    batch, q, k, v, n = shared_prefix_batch(c, ForwardMode.DECODE, toks)
    plan = make_plan(c, batch, n)
    cp = plan_cascade(plan, "always")
    whole, suf, pre = plan.kv_indices_cpu.tolist(), cp.suffix, cp.prefix
    for g_i, g in enumerate(cp.groups):
        shared = pre.kv_indices_cpu[int(pre.kv_indptr_cpu[g_i]) : int(pre.kv_indptr_cpu[g_i + 1])].tolist()
        for b in g.members.tolist():
            own = whole[int(plan.kv_indptr_cpu[b]) : int(plan.kv_indptr_cpu[b + 1])]
            rest = suf.kv_indices_cpu[int(suf.kv_indptr_cpu[b]) : int(suf.kv_indptr_cpu[b + 1])].tolist()
            assert shared + rest == own
            assert int(suf.kv_lens_cpu[b]) + len(shared) * 4 == int(plan.kv_lens_cpu[b])
    assert cp.rows is not None and sorted(cp.rows.tolist()) == [0, 1, 2, 3, 4]
