"""Shared-prefix (cascade) attention inside decode CUDA graphs (``GraphState(cascade=...)``): the
shared pages found at each update (host batch, device page table, token-slot table), the suffix /
prefix buffers, and the replayed launches against the float32 reference of the whole batch."""

from __future__ import annotations

import dataclasses
import math

import fa3_standin
import numpy as np
import pytest
import torch
from batches import brute_groups, fresh_provider_instances, rel_err

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, UnsupportedFeature
from attnplug.core.cascade import graph_groups, min_saved_pages
from attnplug.core.cuda_graph import GraphState
from attnplug.core.kernels.merge import merge_splits, merge_state
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
PAD_PAGE = 0


def cfg(dtype=torch.bfloat16, head_dim=32):
    return AttentionConfig(8, 2, head_dim, PAGE, dtype)


HEAD_DIM = {"triton": 32, "fa3": 64}  # FA3's smallest head dim is 64


@pytest.fixture(params=["triton", "fa3"])
def provider(request, monkeypatch):
    """The provider whose decode graphs run the cascade: triton, and fa3 (the real FA3 on a Hopper
    GPU; the FA3 stand-in on CPU, so the provider's own cascade logic runs in CI)."""
    if request.param == "fa3":
        fa3_standin.use_fa3(monkeypatch, DEV)
    return request.param


# (groups of (requests, shared tokens), unique tokens each, common preamble, loners)
CASES = {
    "one group": ([(4, 40)], 6, 0, 0),
    "ends mid-page": ([(3, 37)], 5, 0, 0),
    "two groups, nothing common to all": ([(2, 20), (2, 20)], 5, 0, 0),
    "nested: a preamble common to all": ([(2, 20), (2, 20)], 5, 13, 0),
    "nothing shared": ([(1, 0)] * 4, 9, 0, 0),
    "a loner": ([(3, 30)], 4, 0, 1),
    "one request": ([(1, 30)], 4, 0, 0),
}


def prefix_slots(gs, batch, bs, groups, q=1):
    """The prefix batch the update wrote equals ``groups`` (:func:`brute_groups`): slot ``g`` of a cut
    group holds its first request's cut pages and its members' rows (``q`` a request); every other
    slot no keys."""
    lens = [0] * (bs + 1)
    for s, _, _, p in groups:
        lens[s] = p * PAGE
    cg = gs.cascade
    assert cg.kv_lens[: bs + 1].tolist() == lens
    ind, qo = cg.kv_indptr.tolist(), cg.qo_indptr.tolist()
    for s, e, _, p in groups:
        if p:
            a = int(batch.kv_indptr[s])
            assert cg.kv_indices[ind[s] : ind[s] + p].tolist() == batch.kv_indices[a : a + p].tolist()
            assert (qo[s], qo[s + 1]) == (s * q, e * q), "the group's query rows"


def same_prefix_batch(host, dev, bs, n):
    """Both update paths wrote the same groups, prefix batch, tile list and group counter."""
    h, d = host.cascade, dev.cascade
    for key in ("shared", "group_start", "group_end"):
        assert getattr(h, key)[:n].tolist() == getattr(d, key)[:n].tolist(), key
    for key, m in (("qo_indptr", bs + 2), ("kv_indptr", bs + 2), ("kv_lens", bs + 1), ("kv_last_page_len", bs + 1)):
        assert getattr(h, key)[:m].tolist() == getattr(d, key)[:m].tolist(), key
    total = int(h.kv_indptr[bs + 1])
    assert h.kv_indices[:total].tolist() == d.kv_indices[:total].tolist()
    assert h.tiles[bs] is not None and d.tiles[bs] is not None
    for a, b in zip(h.tiles[bs][:2], d.tiles[bs][:2]):
        assert a.tolist() == b.tolist(), "tile list"
    assert (h.tiles[bs].count is None) == (d.tiles[bs].count is None)
    if h.tiles[bs].count is not None:
        assert int(h.tiles[bs].count) == int(d.tiles[bs].count), "tile count"
    assert bool(h.active) == bool(d.active) and (int(h.counts[2]) > 0) == (int(d.counts[2]) > 0)


def prefix_on_prefill_kernel(monkeypatch, c, **extra):
    """A ``noncausal`` tile entry naming the prefill kernel (16-row tiles) for ``c``: cascade prefix parts run it."""
    from attnplug.core.kernels import tiles

    entry = {"kernel": "prefill", "block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2, **extra}
    monkeypatch.setitem(tiles.TILES, tiles.key(c.head_dim, c.group_size, "noncausal"), entry)


def make_case(name, seed=0, dtype=torch.bfloat16, provider="triton"):
    groups, unique, nested, loners = CASES[name]
    toks = prompts(groups + [(1, 0)] * loners, unique, nested=nested, seed=seed)
    c = cfg(dtype, HEAD_DIM[provider])
    batch, q, k, v, num_pages = shared_prefix_batch(c, ForwardMode.DECODE, toks, seed=seed, device=DEV)
    k[PAD_PAGE] = 0.5  # the pad page: finite (padded rows read it)
    v[PAD_PAGE] = 0.25
    return c, batch, q, k, v, num_pages


def tables(batch, num_pages, seed):
    """The batch as vLLM's block table ``[B, W]`` and as SGLang's token-slot table (permuted rows)."""
    ind, idx = batch.kv_indptr.tolist(), batch.kv_indices.tolist()
    B = len(ind) - 1
    W = max(ind[b + 1] - ind[b] for b in range(B)) + 3
    bt = torch.full((B, W), num_pages - 1, dtype=torch.int32)  # junk past each row's pages
    for b in range(B):
        bt[b, : ind[b + 1] - ind[b]] = torch.tensor(idx[ind[b] : ind[b + 1]], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(B + 2, generator=g)[:B]
    tok = torch.full((B + 2, W * PAGE), 7, dtype=torch.int64)
    tok[rows] = (bt.long()[:, :, None] * PAGE + torch.arange(PAGE)).reshape(B, W * PAGE)
    last = batch.kv_last_page_len
    seq = ((batch.kv_indptr[1:] - batch.kv_indptr[:-1] - 1) * PAGE + last).to(torch.int32)
    return seq, bt, tok, rows


def state(c, mode="always", max_batch=6, provider="triton", **kw):
    return GraphState(
        c,
        provider,
        max_batch=max_batch,
        max_tokens=max_batch,
        max_pages=400,
        device=DEV,
        pad_page=PAD_PAGE,
        max_seq_len=96,
        cascade=mode,
        **kw,
    )


def check_out(c, batch, q, k, v, num_pages, gs, bs):
    B = batch.batch_size
    qpad = torch.cat([q, torch.randn(bs - B, *q.shape[1:]).to(q)])
    out = torch.full_like(qpad, math.nan)
    lse = torch.full((bs, c.num_qo_heads), math.nan, dtype=torch.float32, device=DEV)
    gs.run(bs, qpad, k, v, out, lse)
    ref, ref_lse = reference_attention(make_plan(c, batch, num_pages, device=DEV), q, k, v)
    assert rel_err(out[:B], ref) < 1e-2
    assert torch.allclose(lse[:B], ref_lse.float(), atol=2e-2), "merged LSE is the whole batch's"
    assert torch.isfinite(out[B:]).all(), "padded rows (the pad page, plus the shared prefix) stay finite"


@pytest.mark.parametrize("name", list(CASES))
def test_host_update_cuts_the_common_prefix_and_equals_reference(name, provider):
    c, batch, q, k, v, n = make_case(name, provider=provider)
    gs = state(c, provider=provider)
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    gs.update(batch, bs)
    groups = brute_groups(batch, PAGE)
    kv = ((batch.kv_indptr[1:] - batch.kv_indptr[:-1] - 1) * PAGE + batch.kv_last_page_len).numpy()
    start, end, found = graph_groups(batch.kv_indptr.numpy(), batch.kv_indices.numpy(), kv, PAGE)
    assert [(int(start[s]), int(end[s]), int(found[s])) for s, *_ in groups] == [g[:3] for g in groups]
    assert int(gs.cascade.shared[0]) == groups[0][2]
    prefix_slots(gs, batch, bs, groups)
    cut = [p for *_, p in groups if p]
    if name == "one group":
        assert cut == [10]  # 40 shared tokens: 10 whole pages; each request's last token is its own
    if name == "ends mid-page":
        assert cut == [9]  # the tail of page 10 stays in every suffix
    if name == "two groups, nothing common to all":
        assert cut == [5, 5]  # no page common to all: each group's own 20 tokens
    check_out(c, batch, q, k, v, n, gs, bs)


@pytest.mark.parametrize("name", ["one group", "ends mid-page", "nothing shared", "one request"])
def test_split_prefix_part_merges_into_the_suffix(name):
    """Split-KV plans (forced, as long contexts get them): the prefix part's splits merge straight
    into the suffix state (``TritonProvider.run_merge``, one merge launch), equal to the reference."""
    c, batch, q, k, v, n = make_case(name, seed=7)
    gs = state(c, num_kv_splits=3)
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    assert gs.cascade.plans[bs].state.num_splits == 3
    gs.update(batch, bs)
    check_out(c, batch, q, k, v, n, gs, bs)
    seq, bt, *_ = tables(batch, n, seed=2)
    gs.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)
    check_out(c, batch, q, k, v, n, gs, bs)


@pytest.mark.parametrize("splits, partials", [(3, None), (3, "out"), (8, None), (1, None)])
@pytest.mark.parametrize("name", ["one group", "ends mid-page", "nothing shared"])
def test_prefix_part_on_the_prefill_kernel(name, splits, partials, monkeypatch):
    """A ``noncausal`` tile entry naming the prefill kernel: the prefix part runs it non-causal, split
    (partials, float32 or bf16, merged straight into the suffix state) or not, equal to the reference;
    eager cascade too. A split without keys (all of them when nothing is shared; 5 of 8 over the
    40-token prefix) writes no partial (they stay NaN) and the merge does not need one. Only the cut
    groups have tiles (none when nothing is shared), their count written by both update paths, and the
    launch's programs stride over them."""
    from attnplug.core import PagedAttention

    c, batch, q, k, v, n = make_case(name, seed=11)
    prefix_on_prefill_kernel(monkeypatch, c, **({"partials": partials} if partials else {}))
    gs = state(c, num_kv_splits=splits)
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    st = gs.cascade.plans[bs].state
    assert (st.kernel, st.num_splits, st.block_m) == ("prefill", splits, 16)
    assert st.tile_count is not None and 1 <= st.grid_tiles <= st.num_tiles
    if splits > 1:
        assert st.partial.dtype == (torch.bfloat16 if partials == "out" else torch.float32)
        st.partial.fill_(math.nan)
    gs.update(batch, bs)
    check_out(c, batch, q, k, v, n, gs, bs)
    cut_tiles = sum(-(-(e - s) // st.block_q) for s, e, _, p in brute_groups(batch, PAGE) if p)
    assert int(st.tile_count) == cut_tiles and (cut_tiles == 0) == (name == "nothing shared")
    assert gs.cascade.tiles[bs].tile_req[:cut_tiles].tolist() == [
        s for s, e, _, p in brute_groups(batch, PAGE) if p for _ in range(-(-(e - s) // st.block_q))
    ]
    if splits > 1:
        keys = int(gs.cascade.kv_lens.sum())
        per_split = -(-keys // splits)
        chunk = -(-per_split // 16) * 16
        used = -(-keys // chunk) if keys else 0
        assert (name == "nothing shared") == (used == 0) and used <= splits and (splits < 8 or used < splits)
        written = ~torch.isnan(st.partial[:bs].float()).all(-1).all(0).all(0)  # [S]: a split's partial was stored
        assert written.tolist() == [s < used for s in range(splits)], (keys, chunk, written.tolist())
    st.tile_count.fill_(-1)
    seq, bt, *_ = tables(batch, n, seed=3)
    gs.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)  # the device path writes the same count
    assert int(st.tile_count) == cut_tiles
    check_out(c, batch, q, k, v, n, gs, bs)
    attn = PagedAttention(c, "triton", DEV, cascade="always")
    plan = attn.plan(batch, num_pages=n, num_kv_splits=splits)
    assert (plan.cascade is None) == (name == "nothing shared")
    if plan.cascade is not None:
        assert plan.cascade.prefix.state.kernel == "prefill"
    out = torch.full_like(q, math.nan)
    attn.run(q, k, v, out=out)
    ref, _ = reference_attention(make_plan(c, batch, n, device=DEV), q, k, v)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("splits", [1, 2])
def test_strided_prefix_part_covers_every_cut_tile(splits, monkeypatch):
    """One program a KV head and split (``grid_tiles`` 1) strides over every tile the update cut (two groups:
    two tiles): the output equals the reference."""

    c, batch, q, k, v, n = make_case("two groups, nothing common to all", seed=5)
    prefix_on_prefill_kernel(monkeypatch, c)
    gs = state(c, num_kv_splits=splits)
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    plan = gs.cascade.plans[bs]
    plan.state = dataclasses.replace(plan.state, grid_tiles=1)
    gs.update(batch, bs)
    assert int(plan.state.tile_count) == 2
    check_out(c, batch, q, k, v, n, gs, bs)


@pytest.mark.parametrize("block_h", [None, 4])
def test_merge_splits_into_a_base_state(block_h):
    """``merge_splits(base=True)``: splits merge into the state already in ``(out, lse)``; rows whose
    splits are all empty are not written (their partials may hold NaN); an empty base
    (LSE -inf, output NaN) contributes nothing."""
    g = torch.Generator().manual_seed(4)
    T, H, S, D = 5, 3, 4, 32
    p = torch.randn(T, H, S, D, generator=g)
    pl2 = torch.randn(T, H, S, generator=g) * 3
    pl2[1] = -math.inf  # row 1: every split empty
    p[1] = math.nan
    pl2[2, :, 1:] = -math.inf  # row 2: one split with keys
    p[2, :, 1:] = math.nan
    base = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    base_lse = torch.randn(T, H, generator=g)
    base_lse[3] = -math.inf  # row 3: the base is empty
    base[3] = math.nan
    ln2 = math.log(2.0)
    lse_all = torch.cat([pl2 * ln2, base_lse[..., None]], dim=2)  # natural log, [T, H, S + 1]
    vals = torch.cat([p, base.float()[:, :, None]], dim=2)
    w = torch.softmax(lse_all, dim=2).nan_to_num()
    want = (vals.nan_to_num() * w[..., None]).sum(2)
    want_lse = torch.logsumexp(lse_all, dim=2)
    out, lse = base.clone().to(DEV), base_lse.clone().to(DEV)
    merge_splits(p.to(DEV), pl2.to(DEV), out, lse, base=True, block_h=block_h)
    out, lse = out.cpu(), lse.cpu()
    keep = [0, 2, 3, 4]
    assert rel_err(out[keep], want[keep]) < 1e-2 and torch.allclose(lse[keep], want_lse[keep], atol=1e-4)
    assert torch.equal(out[1], base[1]) and torch.equal(lse[1], base_lse[1]), "all splits empty: untouched"
    assert torch.isfinite(out[keep]).all()
    with pytest.raises(ValueError, match="lse is required"):
        merge_splits(p.to(DEV), pl2.to(DEV), out.to(DEV), None, base=True)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("form", ["block_table", "token_table"])
def test_device_update_matches_host_update(name, form, provider):
    """The device path (vLLM block table; SGLang token slots with row ids) finds the same prefix and
    writes the same suffix CSR as the host path, with no host read."""
    c, batch, q, k, v, n = make_case(name, seed=3, provider=provider)
    bs = batch.batch_size + 2
    host, dev = state(c, provider=provider), state(c, provider=provider)
    host.prepare_capture(bs)
    dev.prepare_capture(bs)
    before = host.cascade_counts.tolist(), dev.cascade_counts.tolist()
    host.update(batch, bs)
    seq, bt, tok, rows = tables(batch, n, seed=5)
    for _ in range(2):  # two replays: the proof counters add up
        if form == "block_table":
            dev.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)
        else:
            dev.update_from_block_table(seq.to(DEV), tok.to(DEV), bs, row_ids=rows.to(DEV), entry_tokens=PAGE)
    groups = brute_groups(batch, PAGE)
    assert int(dev.cascade.shared[0]) == groups[0][2]
    cut = int(host.cascade.kv_lens.sum())  # tokens the host path cut (0: nothing shared, or not worth it)
    assert cut == sum(p for *_, p in groups) * PAGE
    assert (cut > 0) == (name not in ("nothing shared", "one request"))
    add = lambda c, k: [x + k * y for x, y in zip(c, [int(cut > 0), cut])]  # noqa: E731
    assert host.cascade_counts.tolist() == add(before[0], 1), "host update: (+1 cut, +tokens) when cut"
    assert bool(host.cascade.active) == bool(dev.cascade.active) == (cut > 0), "the IF node's predicate"
    assert dev.cascade_counts.tolist() == add(before[1], 2), "device updates count on the device"
    hv, dv = host.static_views(bs), dev.static_views(bs)
    for key in ("kv_indptr", "kv_last_page_len", "kv_lens"):
        assert getattr(hv, key).tolist() == getattr(dv, key).tolist(), key
    nnz = int(hv.kv_indptr[-1])
    assert hv.kv_indices[:nnz].tolist() == dv.kv_indices[:nnz].tolist()
    same_prefix_batch(host, dev, bs, batch.batch_size)
    prefix_slots(dev, batch, bs, groups)
    check_out(c, batch, q, k, v, n, dev, bs)


def test_graph_of_one_request_has_no_cascade_part(provider):
    """A graph captured for one request (nothing to share) has no prefix plan and runs the plain plan:
    both update paths leave the prefix batch untouched and the output equals the reference."""
    c, batch, q, k, v, n = make_case("one request", provider=provider)
    gs = state(c, provider=provider)
    gs.prepare_capture(1)
    gs.prepare_capture(2)
    assert 1 not in gs.cascade.plans and 2 in gs.cascade.plans
    before = gs.cascade_counts.tolist()
    gs.cascade.kv_lens.fill_(-7)  # a prefix part that ran would see it
    gs.update(batch, 1)
    check_out(c, batch, q, k, v, n, gs, 1)
    seq, bt, *_ = tables(batch, n, seed=2)
    gs.update_from_block_table(seq.to(DEV), bt.to(DEV), 1)
    check_out(c, batch, q, k, v, n, gs, 1)
    assert gs.static_views(1).kv_lens.tolist() == seq.tolist(), "the plain plan holds every key"
    assert (gs.cascade.kv_lens == -7).all() and gs.cascade_counts.tolist() == before


def test_merges_read_the_providers_own_lse(provider):
    """Without an ``lse`` output the cascade's merges read what ``run_lse`` returns (fa3: a ``[T, Hq]``
    view of FA3's own ``[Hq, T]`` LSE, not copied into the buffer): graph and eager cascades equal the
    reference, and ``run_lse`` gives ``run``'s output and LSE."""
    c, batch, q, k, v, n = make_case("one group", provider=provider)
    B, bs = batch.batch_size, batch.batch_size + 1
    ref, _ = reference_attention(make_plan(c, batch, n, device=DEV), q, k, v)
    gs = state(c, provider=provider)
    gs.prepare_capture(bs)
    gs.update(batch, bs)
    out = torch.full((bs, *q.shape[1:]), math.nan, dtype=q.dtype, device=DEV)
    gs.run(bs, torch.cat([q, q[:1]]), k, v, out)
    assert rel_err(out[:B], ref) < 1e-2
    attn = PagedAttention(c, provider, DEV, cascade="always")
    plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None
    out = torch.full_like(q, math.nan)
    attn.run(q, k, v, out=out)
    assert rel_err(out, ref) < 1e-2
    sp = plan.cascade.suffix
    o1, o2 = torch.empty_like(q), torch.empty_like(q)
    l1 = torch.empty(q.shape[0], c.num_qo_heads, dtype=torch.float32, device=DEV)
    l2 = torch.full_like(l1, math.nan)
    attn.provider.run(sp, q, k, v, o1, l1)
    s = attn.provider.run_lse(sp, q, k, v, o2, l2)
    assert torch.equal(o1, o2) and s.shape == l1.shape and torch.allclose(s, l1)
    if provider == "fa3":
        assert s.data_ptr() != l2.data_ptr() and torch.isnan(l2).all(), "FA3's own LSE, not copied"
    else:
        assert s is l2


def test_cost_model_keeps_small_prefixes_whole(provider):
    """``auto``: a prefix saving less than MIN_SAVED_BYTES is not cut (empty prefix part), and the
    result is still the whole batch's; ``always`` cuts it."""
    c, batch, q, k, v, n = make_case("one group", provider=provider)
    assert min_saved_pages(c, "auto") > 100 and min_saved_pages(c, "always") == 1
    gs = state(c, mode="auto", provider=provider)
    bs = batch.batch_size
    gs.prepare_capture(bs)
    seq, bt, *_ = tables(batch, n, seed=1)
    gs.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)
    assert int(gs.cascade.shared[0]) == 10 and int(gs.cascade.kv_lens.sum()) == 0  # found, not worth it
    assert gs.static_views(bs).kv_lens.tolist() == seq.tolist()
    check_out(c, batch, q, k, v, n, gs, bs)
    gs.update(batch, bs)
    assert int(gs.cascade.kv_lens.sum()) == 0
    check_out(c, batch, q, k, v, n, gs, bs)


def test_replays_change_the_group_in_place(provider):
    """One captured bs, successive batches with different prefixes (and none): every replay reads
    the buffers the last update wrote; the plans and their tensors are never replaced."""
    c = cfg(head_dim=HEAD_DIM[provider])
    gs = state(c, provider=provider)
    bs = 5
    plan = gs.prepare_capture(bs)
    pplan = gs.cascade.plans[bs]
    ptrs = (plan.kv_indices.data_ptr(), pplan.kv_indices.data_ptr(), pplan.kv_lens.data_ptr())
    for name, seed in (
        ("one group", 0),
        ("nothing shared", 1),
        ("nested: a preamble common to all", 2),
        ("ends mid-page", 3),
    ):
        _, batch, q, k, v, n = make_case(name, seed=seed, provider=provider)
        seq, bt, *_ = tables(batch, n, seed)
        gs.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)
        assert gs.plans[bs] is plan and gs.cascade.plans[bs] is pplan
        assert (plan.kv_indices.data_ptr(), pplan.kv_indices.data_ptr(), pplan.kv_lens.data_ptr()) == ptrs
        check_out(c, batch, q, k, v, n, gs, bs)


def test_cascade_graphs_refused_where_not_supported(monkeypatch):
    from attnplug.core.providers.base import GraphSupport
    from attnplug.core.providers.triton import TritonProvider

    c = cfg()
    monkeypatch.setattr(TritonProvider, "graph_support", GraphSupport(decode=True, verify=True, device_refresh=True))
    with pytest.raises(UnsupportedFeature, match=r"attnplug: provider 'triton' .*cascade.*verify"):
        GraphState(
            c,
            "triton",
            max_batch=2,
            max_tokens=8,
            max_pages=10,
            device=DEV,
            mode="verify",
            num_draft_tokens=4,
            cascade="auto",
        )
    monkeypatch.undo()
    with pytest.raises(ValueError, match="ATTNPLUG_CASCADE"):
        state(c, mode="sometimes")
    assert state(c, mode="off").cascade is None


def test_merge_ignores_an_empty_state_whatever_it_holds():
    """An empty part (LSE -inf) contributes nothing even when its output holds NaN (an empty
    prefix part's scratch)."""
    g = torch.Generator().manual_seed(0)
    va, vb = torch.randn(3, 2, 32, generator=g).to(DEV), torch.full((3, 2, 32), math.nan, device=DEV)
    sa, sb = torch.randn(3, 2, generator=g).to(DEV), torch.full((3, 2), -math.inf, device=DEV)
    out, so = torch.empty_like(va), torch.empty_like(sa)
    merge_state(va, sa, vb, sb, out, so)
    assert torch.equal(out, va) and torch.allclose(so, sa)
    assert np.isfinite(out.cpu().numpy()).all()


@pytest.mark.parametrize("block_h", [None, 2])
def test_in_place_merge_leaves_rows_with_an_empty_state_untouched(block_h):
    """In place (the cascade's suffix output is state A): rows (and heads) whose state B is empty are
    neither read nor rewritten; the others are the exact merge."""
    g = torch.Generator().manual_seed(1)
    va, vb = torch.randn(4, 2, 32, generator=g).to(DEV), torch.randn(4, 2, 32, generator=g).to(DEV)
    sa, sb = torch.randn(4, 2, generator=g).to(DEV), torch.randn(4, 2, generator=g).to(DEV)
    sb[1:3] = -math.inf
    vb[1:3] = math.nan
    sb[0, 1] = -math.inf  # one head of a row whose other head merges
    vb[0, 1] = math.nan
    want_v = (va * sa.exp()[..., None] + vb.nan_to_num() * sb.exp()[..., None]) / (sa.exp() + sb.exp())[..., None]
    want_s = torch.logaddexp(sa, sb)
    out, so = va.clone(), sa.clone()
    merge_state(out, so, vb, sb, out, so, block_h=block_h)
    assert torch.allclose(out, want_v, atol=1e-5) and torch.allclose(so, want_s, atol=1e-5)
    assert torch.equal(out[1:3], va[1:3]) and torch.equal(so[1:3], sa[1:3])
    assert torch.equal(out[0, 1], va[0, 1]) and torch.equal(so[0, 1], sa[0, 1])


@pytest.mark.parametrize("kind", ["graph", "graph_cascade"])
def test_bench_graph_rows_compute_the_row(kind, provider, monkeypatch):
    """The benchmark's decode-graph implementations (``python -m attnplug.bench``) give the float32
    reference on the shared-prefix row, the cascade one with the prefix cut (cost model forced)."""
    from attnplug.bench import impls
    from attnplug.bench import workloads as W

    impl = f"attnplug.{provider}.{kind}"
    monkeypatch.setattr("attnplug.core.cascade.MIN_SAVED_BYTES", 1)
    row = next(r for r in W.QUICK_ROWS if r.shared)
    work = W.build(row, AttentionConfig(**W.QUICK_CONFIG), torch.device(DEV))
    fn = next(i for i in impls.IMPLS if i.name == impl).make(work)
    out = fn()
    assert W.rel_err(out[: row.batch], W.reference(work, row.batch)) < 1e-2
    if impl.endswith("cascade"):
        assert work.extra[f"{impl}.shared_pages"] == row.shared // work.config.page_size
    plain = W.build(W.QUICK_ROWS[0], AttentionConfig(**W.QUICK_CONFIG), torch.device(DEV))  # no shared-prefix twin
    with pytest.raises(impls.NotApplicable):
        next(i for i in impls.IMPLS if i.name == impl).make(plain)


HAS_IF_NODES = DEV == "cuda" and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


@pytest.mark.skipif(not HAS_IF_NODES, reason="CUDA-graph IF nodes need a CUDA build of torch with them")
@pytest.mark.parametrize("first", ["one group", "nothing shared"])
def test_captured_prefix_part_replays_only_when_a_prefix_is_cut(provider, first, monkeypatch):
    """One capture (after a ``first`` batch), then replays of a shared batch and of one that shares
    nothing, through device-table updates: each equals the float32 reference. The prefix part sits
    in an IF node (``ATTNPLUG_GRAPH_IF=1``): with nothing cut, a bogus prefix batch planted in its
    buffers is not read."""
    monkeypatch.setenv("ATTNPLUG_GRAPH_IF", "1")
    cases = {name: make_case(name, seed=11, provider=provider) for name in ("one group", "nothing shared")}
    c = cases["one group"][0]
    pages = max(x[5] for x in cases.values())
    K = torch.zeros(pages, *cases["one group"][3].shape[1:], dtype=c.kv_dtype, device=DEV)
    V = torch.zeros_like(K)
    bs = 1 + max(x[1].batch_size for x in cases.values())
    Q = torch.zeros(bs, c.num_qo_heads, c.head_dim, dtype=c.dtype, device=DEV)
    out = torch.empty_like(Q)
    gs = state(c, provider=provider)
    gs.prepare_capture(bs)

    def load(name):
        _, batch, q, k, v, n = cases[name]
        K.zero_(), V.zero_(), Q.normal_()
        K[:n], V[:n], Q[: batch.batch_size] = k, v, q
        seq, bt, *_ = tables(batch, n, seed=1)
        gs.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)
        return batch, n

    load(first)
    gs.run(bs, Q, K, V, out)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gs.run(bs, Q, K, V, out)
    for name in ("one group", "nothing shared", "one group", "nothing shared"):
        batch, n = load(name)
        assert bool(gs.cascade.active) == (name == "one group")
        if name == "nothing shared":  # a prefix batch the replay must not read: request 0's pages
            m = int(batch.kv_indptr[1])
            gs.cascade.kv_indices[:m].copy_(batch.kv_indices[:m].to(DEV))
            gs.cascade.kv_indptr[1].fill_(m)
            gs.cascade.kv_lens[0].fill_(m * PAGE)
        g.replay()
        torch.cuda.synchronize()
        B = batch.batch_size
        ref, _ = reference_attention(make_plan(c, batch, n, device=DEV), Q[:B], K[:n], V[:n])
        assert rel_err(out[:B], ref) < 1e-2, name


def test_prefix_part_launches_as_a_programmatic_dependent(monkeypatch):
    """With programmatic dependent launch available (sm90+; forced here, the launches recorded instead of
    run): in a cascade graph the prefix part is one prefill-kernel launch (its splits merge into the
    suffix state in the kernel) that launches as a dependent (``launch_pdl``) of the suffix part, whose
    paged kernel lets it start at once (``PDL``); eager cascade runs and IF-node captures launch nothing
    as a dependent; without PDL nothing does."""
    import attnplug.core.graph_if as graph_if
    import attnplug.core.kernels.attention as attention_mod
    import attnplug.core.kernels.merge as merge_mod
    import attnplug.core.kernels.prefill as prefill_mod
    import attnplug.core.providers.triton as triton_provider_mod
    from attnplug.core.kernels import pdl
    from attnplug.core.providers.triton import TritonProvider

    # the suffix on the paged kernel, as on one SM (a GPU's SM count plans the Hopper decode kernel, which
    # this recorder does not stand in for): fresh provider instances planned for one SM
    monkeypatch.setattr(triton_provider_mod, "_num_sms", lambda device: 1)
    fresh_provider_instances(monkeypatch)
    assert not pdl.available(torch.device("cpu"))
    monkeypatch.setenv(pdl.PDL_ENV, "sometimes")
    with pytest.raises(ValueError, match="attnplug: ATTNPLUG_PDL"):
        pdl.available(torch.device("cpu"))
    monkeypatch.delenv(pdl.PDL_ENV)

    c, batch, q, k, v, n = make_case("one group", seed=11)
    prefix_on_prefill_kernel(monkeypatch, c)
    gs = state(c, num_kv_splits=3)
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    gs.update(batch, bs)
    attn = PagedAttention(c, "triton", DEV, cascade="always")
    plan = attn.plan(batch, num_pages=n, num_kv_splits=3)
    assert plan.cascade is not None and plan.cascade.prefix.state.kernel == "prefill"

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, kw.get("PDL", False), kw.get("launch_pdl", False)))

    for mod, name in (
        (attention_mod, "paged_attention_kernel"),
        (prefill_mod, "prefill_kernel"),
        (merge_mod, "merge_splits_kernel"),
        (merge_mod, "merge_state_kernel"),
    ):
        monkeypatch.setattr(mod, name, Recorder(name))
    out = torch.empty(bs, *q.shape[1:], dtype=q.dtype, device=DEV)
    lse = torch.empty(bs, c.num_qo_heads, dtype=torch.float32, device=DEV)

    def graph_launches():
        launches.clear()
        gs.run(bs, torch.cat([q, q[:1]]), k, v, out, lse)
        return list(launches)

    monkeypatch.setattr(TritonProvider, "_pdl", lambda self: False)  # a GPU of sm90+ has it by default
    off = graph_launches()
    assert ("prefill_kernel", False, False) in off and not any(p or lp for _, p, lp in off)
    monkeypatch.setattr(TritonProvider, "_pdl", lambda self: True)
    on = graph_launches()
    assert on[-1:] == [("prefill_kernel", True, True)] and on[-2][0] != "prefill_kernel", on
    assert ("paged_attention_kernel", True, False) in on[:-1], on
    assert not any(lp for _, _, lp in on[:-1]), on
    monkeypatch.setattr(graph_if, "requested", lambda: True)  # the prefix part inside an IF node
    assert graph_launches()[-2:] == [("merge_splits_kernel", False, False), ("prefill_kernel", False, False)]
    launches.clear()
    attn.run(q, k, v, out=torch.empty_like(q))
    assert ("prefill_kernel", False, False) in launches and not any(lp for _, _, lp in launches), launches
