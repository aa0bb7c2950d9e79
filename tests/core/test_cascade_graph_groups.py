"""Several shared-prefix groups per batch in decode and verify CUDA graphs (``GraphState(cascade=...)``):
random ragged batches on random page tables, the groups (runs of consecutive requests starting on
one page) cut on the host and on the device, against the float32 reference of the whole batch."""

from __future__ import annotations

import math

import pytest
import torch
from batches import brute_groups, rel_err
from test_cascade_graph import prefix_slots, same_prefix_batch

from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode
from attnplug.core.cuda_graph import GraphState, chain_mask
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
PAD_PAGE = 0
MAX_BATCH = 12
QV = 3  # draft tokens a verify request

# each request names its prompt (same letter: the same physical prefix pages); "." a request of its own
SPECS = {
    "all one group": "AAAAAA",
    "groups of 2, 3 and 4": "AABBBCCCC",
    "loners between groups": "A.BBB.CC.",
    "one prompt, not consecutive": "AABBAA",
    "below the threshold and above": "AABBB.CC",
    "n samples of 4 prompts": "AABBCCDD",
    "nothing shared": "......",
}
# pages each prompt shares (its members then have 1..3 pages of their own, ragged)
PROMPT_PAGES = {"A": 3, "B": 2, "C": 5, "D": 1}


def group_batch(spec: str, q: int, seed: int):
    """A ``spec`` batch: ``q`` query tokens a request, KV ``[pages, P, Hkv, D]`` bf16, pages drawn at random
    from the cache (prompt pages shared by the requests naming the prompt). Verify (``q > 1``): chain masks."""
    c = AttentionConfig(8, 2, 32, PAGE, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randperm(400, generator=g) + 1).tolist()  # page 0 is the pad page
    prompts = {p: [pool.pop() for _ in range(n)] for p, n in PROMPT_PAGES.items()}
    rows, kv_lens = [], []
    for ch in spec:
        own = int(torch.randint(1, 4, (1,), generator=g))
        pages = (prompts[ch] if ch != "." else []) + [pool.pop() for _ in range(own)]
        rows.append(pages)
        kv_lens.append((len(pages) - 1) * PAGE + int(torch.randint(1, PAGE + 1, (1,), generator=g)))
    B = len(rows)
    ind = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).to(torch.int32)
    last = torch.tensor([k - (len(r) - 1) * PAGE for r, k in zip(rows, kv_lens)], dtype=torch.int32)
    mask = torch.cat([chain_mask(q, k).reshape(-1) for k in kv_lens]) if q > 1 else None
    mode = ForwardMode.TARGET_VERIFY if q > 1 else ForwardMode.DECODE
    batch = BatchMetadata(
        mode,
        torch.arange(B + 1, dtype=torch.int32) * q,
        ind,
        torch.tensor(sum(rows, []), dtype=torch.int32),
        last,
        custom_mask=mask,
    )
    n = 402
    k = torch.randn(n, PAGE, 2, 32, generator=g).to(torch.bfloat16)
    v = torch.randn(n, PAGE, 2, 32, generator=g).to(torch.bfloat16)
    k[PAD_PAGE], v[PAD_PAGE] = 0.5, 0.25
    qt = torch.randn(B * q, 8, 32, generator=g).to(torch.bfloat16)
    W = max(len(r) for r in rows) + 2
    bt = torch.full((B, W), n - 1, dtype=torch.int32)  # junk past each row's pages
    for b, r in enumerate(rows):
        bt[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
    seq = torch.tensor(kv_lens, dtype=torch.int32)
    dev = lambda *t: [x.to(DEV) for x in t]  # noqa: E731
    return c, batch, *dev(qt, k, v), n, *dev(seq, bt)


def gstate(c, q: int, min_saved: int | None = None):
    gs = GraphState(
        c,
        "triton",
        max_batch=MAX_BATCH,
        max_tokens=MAX_BATCH * q,
        max_pages=400,
        device=DEV,
        mode="verify" if q > 1 else "decode",
        num_draft_tokens=q,
        pad_page=PAD_PAGE,
        max_seq_len=40,
        cascade="always",
        chain=q > 1,
    )
    if min_saved is not None:
        gs.cascade.min_saved_pages = min_saved  # the cost model's bound, small enough to decide per group
    return gs


def check(c, batch, q, k, v, n, gs, bs, per):
    B = batch.batch_size
    qpad = torch.cat([q, torch.randn((bs - B) * per, *q.shape[1:]).to(q)])
    out = torch.full_like(qpad, math.nan)
    lse = torch.full((bs * per, c.num_qo_heads), math.nan, dtype=torch.float32, device=DEV)
    gs.run(bs, qpad, k, v, out, lse)
    ref, ref_lse = reference_attention(make_plan(c, batch, n, device=DEV), q.float(), k.float(), v.float())
    assert rel_err(out[: B * per], ref) < 1e-2
    assert torch.allclose(lse[: B * per], ref_lse.float(), atol=2e-2)
    assert torch.isfinite(out[B * per :]).all()


@pytest.mark.parametrize("q", [1, QV], ids=["decode", "verify"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_groups_cut_on_host_and_device_equal_reference(spec, q):
    """Host CSR and device block table: the same groups, prefix batch and tile list, each group's
    prefix read once, and the output of the whole batch; the proof counters count the cut groups
    and tokens."""
    min_saved = 4 if spec == "below the threshold and above" else 1
    c, batch, qt, k, v, n, seq, bt = group_batch(SPECS[spec], q, seed=len(spec) + q)
    groups = brute_groups(batch, PAGE, q, min_saved)
    cut = [p for *_, p in groups if p]
    if spec == "below the threshold and above" and q == 1:  # A: 1 * 3 pages < 4 saved; B: 2 * 2 >= 4; C: 1 * 5
        assert [(e - s, p) for s, e, _, p in groups if e - s > 1] == [(2, 0), (3, 2), (2, 5)]
    if spec == "one prompt, not consecutive":
        assert len(cut) == 3, "the two runs of A are groups of their own"
    if spec == "nothing shared":
        assert not cut
    else:
        assert cut, "the spec's prompts are shared"
    bs = batch.batch_size + 2
    host, dev = gstate(c, q, min_saved), gstate(c, q, min_saved)
    host.prepare_capture(bs)
    dev.prepare_capture(bs)
    before = host.cascade.counts.tolist(), dev.cascade.counts.tolist()
    host.update(batch, bs)
    dev.update_from_block_table(seq, bt, bs)
    want = [int(bool(cut)), sum(cut) * PAGE, len(cut)]
    for gs, b in ((host, before[0]), (dev, before[1])):
        assert [x - y for x, y in zip(gs.cascade.counts.tolist(), b)] == want, "(cut, tokens, groups)"
        assert bool(gs.cascade.active) == bool(cut)
        assert gs.cascade_counts.tolist() == gs.cascade.counts[:2].tolist()
        assert gs.cascade_counts is gs.cascade_counts, "one tensor: the adapters poll it by identity"
        prefix_slots(gs, batch, bs, groups, q)
    same_prefix_batch(host, dev, bs, batch.batch_size)
    hv, dv = host.static_views(bs), dev.static_views(bs)
    for key in ("kv_indptr", "kv_last_page_len", "kv_lens"):
        assert getattr(hv, key).tolist() == getattr(dv, key).tolist(), key
    check(c, batch, qt, k, v, n, host, bs, q)
    check(c, batch, qt, k, v, n, dev, bs, q)


def test_replays_move_between_group_layouts():
    """One captured bs, replays of batches with different groups (and none), alternating the host
    and device paths: every replay equals the reference (the tile list and prefix batch are
    rewritten in place each time)."""
    c = AttentionConfig(8, 2, 32, PAGE, torch.bfloat16)
    gs = gstate(c, 1)
    bs = 10
    gs.prepare_capture(bs)
    for i, spec in enumerate(("AABBBCCCC", "......", "A.BBB.CC.", "AAAAAA", "AABBAA")):
        c, batch, qt, k, v, n, seq, bt = group_batch(spec, 1, seed=i)
        if i % 2:
            gs.update_from_block_table(seq, bt, bs)
        else:
            gs.update(batch, bs)
        check(c, batch, qt, k, v, n, gs, bs, 1)


def test_a_prefix_provider_that_cannot_follow_the_groups_is_refused(monkeypatch):
    """A prefix provider without a replay-written tile list (its plan fixed at capture) is refused
    when the graph family is built, naming attnplug, the provider and the feature."""
    from attnplug.core import UnsupportedFeature
    from attnplug.core.providers.base import Provider
    from attnplug.core.providers.triton import TritonProvider

    monkeypatch.setattr(TritonProvider, "graph_tile_list", Provider.graph_tile_list)
    c = AttentionConfig(8, 2, 32, PAGE, torch.bfloat16)
    with pytest.raises(UnsupportedFeature, match=r"attnplug: provider 'triton' .*prefix part of cascade CUDA graphs"):
        gstate(c, 1)
