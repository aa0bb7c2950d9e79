"""Shared-prefix (cascade) attention inside verify CUDA graphs (``GraphState(mode="verify",
cascade=...)``): each update cuts the pages every request shares before its ``q`` draft tokens, from a
host batch with its tree masks (whose columns are cut too) or from a device page table with causal-chain
masks; the replayed launches equal the float32 reference of the whole batch, and the device path writes
what the host path writes."""

from __future__ import annotations

import math

import fa3_standin
import pytest
import torch
from batches import rel_err
from test_cascade_graph import CASES, DEV, HEAD_DIM, PAD_PAGE, PAGE, cfg, tables

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import ForwardMode
from attnplug.core.cuda_graph import GraphState, chain_mask
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

Q = 3  # draft tokens a request


@pytest.fixture(params=["triton", "fa3"])
def provider(request, monkeypatch):
    if request.param == "fa3":
        fa3_standin.use_fa3(monkeypatch, DEV)
    return request.param


def verify_case(name, provider, seed=0, chain=False):
    groups, unique, nested, loners = CASES[name]
    toks = prompts(groups + [(1, 0)] * loners, unique, nested=nested, seed=seed)
    c = cfg(torch.bfloat16, HEAD_DIM[provider])
    batch, q, k, v, n = shared_prefix_batch(c, ForwardMode.TARGET_VERIFY, toks, q_len=Q, seed=seed, device=DEV)
    if chain:  # vLLM's linear drafts: row i sees the committed prefix and draft tokens 0..i
        ind, last = batch.kv_indptr, batch.kv_last_page_len
        kv = ((ind[1:] - ind[:-1] - 1) * PAGE + last).tolist()
        batch.custom_mask = torch.cat([chain_mask(Q, int(x)).reshape(-1) for x in kv]).to(batch.custom_mask)
    k[PAD_PAGE], v[PAD_PAGE] = 0.5, 0.25
    return c, batch, q, k, v, n


def common_pages(batch) -> int:
    """Leading page ids common to every request, within each one's (kv_len - Q) // P pages."""
    ind, idx, last = batch.kv_indptr.tolist(), batch.kv_indices.tolist(), batch.kv_last_page_len.tolist()
    rows = [idx[ind[b] : ind[b + 1]] for b in range(len(ind) - 1)]
    if len(rows) < 2:
        return 0
    lim = min(((len(r) - 1) * PAGE + last[b] - Q) // PAGE for b, r in enumerate(rows))
    s = 0
    while s < lim and all(r[s] == rows[0][s] for r in rows):
        s += 1
    return s


def vstate(c, provider, chain=False, mode="always"):
    return GraphState(
        c,
        provider,
        max_batch=6,
        max_tokens=6 * Q,
        max_pages=400,
        device=DEV,
        mode="verify",
        num_draft_tokens=Q,
        pad_page=PAD_PAGE,
        max_seq_len=96 + Q,
        cascade=mode,
        chain=chain,
    )


def check(c, batch, q, k, v, n, gs, bs):
    B = batch.batch_size
    qpad = torch.cat([q, torch.randn((bs - B) * Q, *q.shape[1:]).to(q)])
    out = torch.full_like(qpad, math.nan)
    lse = torch.full((bs * Q, c.num_qo_heads), math.nan, dtype=torch.float32, device=DEV)
    gs.run(bs, qpad, k, v, out, lse)
    ref, ref_lse = reference_attention(make_plan(c, batch, n, device=DEV), q, k, v)
    assert rel_err(out[: B * Q], ref) < 1e-2
    assert torch.allclose(lse[: B * Q], ref_lse.float(), atol=2e-2)
    assert torch.isfinite(out[B * Q :]).all()


@pytest.mark.parametrize("name", ["one group", "ends mid-page", "nested: a preamble common to all", "nothing shared"])
def test_host_update_cuts_the_common_prefix_and_its_mask_columns(name, provider):
    c, batch, q, k, v, n = verify_case(name, provider, seed=1)
    gs = vstate(c, provider)
    bs = batch.batch_size + 1
    gs.prepare_capture(bs)
    gs.update(batch, bs)
    s = common_pages(batch)
    assert int(gs.cascade.kv_lens.sum()) == s * PAGE and (s > 0) == (name != "nothing shared")
    assert bool(gs.cascade.active) == (s > 0)
    check(c, batch, q, k, v, n, gs, bs)


def same_static_views(host, dev, bs) -> int:
    """The host and device updates left the same suffix CSR and masks in the ``bs`` views; returns the
    mask elements written."""
    hv, dv = host.static_views(bs), dev.static_views(bs)
    for key in ("kv_indptr", "kv_last_page_len", "kv_lens", "mask_indptr", "mask_free"):
        assert getattr(hv, key).tolist() == getattr(dv, key).tolist(), key
    m = int(hv.mask_indptr[-1])
    assert hv.mask[:m].tolist() == dv.mask[:m].tolist()
    return m


@pytest.mark.parametrize("name", ["one group", "ends mid-page", "nothing shared"])
def test_device_chain_update_matches_the_host_update(name, provider):
    """vLLM's verify replays (causal-chain drafts) from its block table: the device finds the same
    prefix (within ``kv_len - q``), writes the same suffix CSR and chain masks as the host path."""
    c, batch, q, k, v, n = verify_case(name, provider, seed=2, chain=True)
    bs = batch.batch_size + 1
    host, dev = vstate(c, provider, chain=True), vstate(c, provider, chain=True)
    host.prepare_capture(bs)
    dev.prepare_capture(bs)
    host.update(batch, bs)
    seq, bt, _, _ = tables(batch, n, seed=5)
    dev.update_from_block_table(seq.to(DEV), bt.to(DEV), bs)
    s = common_pages(batch)
    assert (
        int(dev.cascade.shared[0]) == s
        and int(host.cascade.kv_lens.sum()) == int(dev.cascade.kv_lens.sum()) == s * PAGE
    )
    same_static_views(host, dev, bs)
    check(c, batch, q, k, v, n, dev, bs)
    check(c, batch, q, k, v, n, host, bs)


@pytest.mark.parametrize("name", ["one group", "nested: a preamble common to all", "nothing shared"])
def test_device_tree_update_matches_the_host_update(name, provider):
    """SGLang's verify replays (tree masks) from its token table: the device finds the same prefix,
    writes the same suffix CSR, and copies each request's tree part into the cut mask blocks."""
    c, batch, q, k, v, n = verify_case(name, provider, seed=3)
    bs = batch.batch_size + 1
    host, dev = vstate(c, provider), vstate(c, provider)
    host.prepare_capture(bs)
    dev.prepare_capture(bs)
    host.update(batch, bs)
    seq, _, tok, rows = tables(batch, n, seed=6)
    dev.mask.fill_(0)  # stale values from an earlier replay must not survive
    mask = batch.custom_mask.to(DEV)
    dev.update_from_block_table(seq.to(DEV), tok.to(DEV), bs, row_ids=rows.to(DEV), entry_tokens=PAGE, custom_mask=mask)
    s = common_pages(batch)
    assert int(host.cascade.kv_lens.sum()) == int(dev.cascade.kv_lens.sum()) == s * PAGE
    m = same_static_views(host, dev, bs)
    assert not dev.mask[:m].all()  # the tree parts hide some draft tokens: the copy is not all True
    check(c, batch, q, k, v, n, dev, bs)


def test_device_tree_update_is_refused_where_it_cannot_serve(provider):
    """A chain family generates its masks: an engine mask given to it is refused, not ignored."""
    c, batch, q, k, v, n = verify_case("one group", provider, seed=4, chain=True)
    gs = vstate(c, provider, chain=True)
    bs = batch.batch_size
    gs.prepare_capture(bs)
    seq, bt, _, _ = tables(batch, n, seed=7)
    with pytest.raises(ValueError, match="custom_mask"):
        gs.update_from_block_table(seq.to(DEV), bt.to(DEV), bs, custom_mask=batch.custom_mask.to(DEV))
