"""GraphState buffer logic on CPU: in-place updates touch only the expected slots, padding is harmless."""

from __future__ import annotations

import math

import pytest
import torch
from batches import random_case, rel_err

from attnplug.core import AttentionConfig, ForwardMode, UnsupportedFeature
from attnplug.core.cuda_graph import FILL_SEQ_LEN, GraphState
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -77
MAX_BS = 5
N_DRAFT = 4


def cfg(page):
    return AttentionConfig(4, 2, 32, page, torch.bfloat16)


def state(mode, page, **kw):
    return GraphState(
        cfg(page),
        "triton",
        max_batch=MAX_BS,
        max_tokens=MAX_BS * N_DRAFT,
        max_pages=300,
        device=DEVICE,
        mode=mode,
        num_draft_tokens=N_DRAFT,
        pad_page=3,
        **kw,
    )


def case(mode, B, page, seed):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 40, (B,), generator=g).tolist()
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.TARGET_VERIFY
    q = [1] * B if mode == "decode" else [N_DRAFT] * B
    return random_case(fm, q, prefix, cfg(page), DEVICE, seed=seed, extra_pages=4)


BUFFERS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "mask", "mask_indptr", "mask_free")


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("page", [1, 16])
def test_update_writes_only_expected_slots(mode, page):
    gs = state(mode, page)
    for bs in range(1, MAX_BS + 1):
        gs.prepare_capture(bs)
    bufs = {n: getattr(gs, n) for n in BUFFERS if getattr(gs, n) is not None}
    ptrs = {n: b.data_ptr() for n, b in bufs.items()}
    q = 1 if mode == "decode" else N_DRAFT
    for bs in range(1, MAX_BS + 1):
        for B in sorted({1, bs, max(1, bs - 2)}):
            c = case(mode, B, page, seed=bs * 10 + B)
            for b in bufs.values():
                b.fill_(SENTINEL)
            plan = gs.update(c.batch, bs)
            assert plan is gs.plans[bs]
            assert {n: b.data_ptr() for n, b in bufs.items()} == ptrs, "a buffer was reallocated"
            pad = bs - B
            n = c.batch.kv_indices.numel()
            pp = gs.pad_pages
            pad_kv = FILL_SEQ_LEN + (q if mode == "verify" else 0)
            assert pad_kv == gs.pad_kv_len and pp == -(-pad_kv // page)
            b_ = c.batch
            exp_indptr = torch.cat([b_.kv_indptr, n + torch.arange(1, pad + 1, dtype=torch.int32) * pp])
            exp_idx = torch.cat([b_.kv_indices, torch.full((pad * pp,), 3, dtype=torch.int32)])
            exp_last = torch.cat([b_.kv_last_page_len, torch.full((pad,), pad_kv - (pp - 1) * page, dtype=torch.int32)])
            npg = exp_indptr.diff()
            exp_lens = torch.where(npg > 0, (npg - 1) * page + exp_last, 0)
            assert (exp_lens[B:] == pad_kv).all()
            cpu = {k: v.cpu() for k, v in bufs.items()}

            def written(name, upto, expected, cpu=cpu):
                t = cpu[name]
                assert torch.equal(t[:upto], expected.to(t.dtype)), name
                assert (t[upto:] == SENTINEL).all(), f"{name}: wrote past slot {upto}"

            written("kv_indptr", bs + 1, exp_indptr)
            written("kv_indices", n + pad * pp, exp_idx)
            written("kv_last_page_len", bs, exp_last)
            written("kv_lens", bs, exp_lens)
            assert (cpu["qo_indptr"] == SENTINEL).all(), "qo_indptr is constant; update must not write it"
            if mode == "verify":
                m = c.batch.custom_mask.numel()
                tot = m + pad * q * pad_kv
                written(
                    "mask",
                    tot,
                    torch.cat([c.batch.custom_mask.to(torch.uint8), torch.ones(tot - m, dtype=torch.uint8)]),
                )
                assert cpu["mask_indptr"][0] == SENTINEL
                written("mask_free", bs, exp_lens - q)
                mi = torch.cumsum(exp_lens.long() * q, 0)
                assert torch.equal(cpu["mask_indptr"][1 : bs + 1], mi)
                assert (cpu["mask_indptr"][bs + 1 :] == SENTINEL).all()


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("page", [1, 16])
def test_padded_replay_equals_eager(mode, page):
    """Plans refreshed in place give the reference result on the real rows; padded rows stay finite."""
    gs = state(mode, page, num_kv_splits=2)
    bs = 3
    plan = gs.prepare_capture(bs)
    q_per = 1 if mode == "decode" else N_DRAFT
    for B, seed in ((2, 1), (3, 2), (1, 3)):
        c = case(mode, B, page, seed)
        k, v = c.k_cache, c.v_cache
        k[3] = 0.5  # the pad page holds finite values
        v[3] = 0.25
        assert gs.update(c.batch, bs) is plan
        T = B * q_per
        qpad = torch.cat([c.q, torch.randn(bs * q_per - T, *c.q.shape[1:]).to(c.q)])
        out = torch.full_like(qpad, math.nan)
        gs.run(bs, qpad, k, v, out)
        ref, _ = reference_attention(make_plan(c.config, c.batch, c.num_pages, device=DEVICE), c.q, k, v)
        assert rel_err(out[:T], ref) < 1e-2
        assert torch.isfinite(out[T:]).all()
        assert torch.allclose(out[T:].float(), torch.full_like(out[T:].float(), 0.25)), "padded rows read the pad page"


def test_refusals():
    with pytest.raises(UnsupportedFeature, match="reference"):
        GraphState(cfg(16), "reference", 2, 2, 10, device="cpu")
    with pytest.raises(ValueError, match="max_tokens"):
        GraphState(cfg(16), "triton", 4, 3, 10, device=DEVICE)
    gs = state("decode", 16)
    gs.prepare_capture(2)
    with pytest.raises(ValueError, match="no captured batch size"):
        gs.update(case("decode", 3, 16, 0).batch)
    with pytest.raises(ValueError, match="max_pages"):
        gs.update(random_case(ForwardMode.DECODE, [1, 1], [3000, 3000], cfg(16), DEVICE).batch)


def test_verify_mask_hiding_the_prefix_is_refused():
    """The verify graphs assume every draft token sees the whole committed prefix (mask_free =
    kv_len - q): a host mask that hides a prefix column fails loudly instead of being ignored."""
    gs = state("verify", 16)
    gs.prepare_capture(2)
    c = random_case(ForwardMode.TARGET_VERIFY, [N_DRAFT] * 2, [10, 20], cfg(16), "cpu", seed=3)
    assert gs.update(c.batch, 2) is gs.plans[2]  # a tree mask over the draft tokens only: fine
    kv0 = 10 + N_DRAFT
    c.batch.custom_mask[kv0 + 5] = False  # request 0, draft token 1, prefix column 5
    with pytest.raises(
        UnsupportedFeature,
        match="attnplug: provider 'triton' CUDA-graph verify .* request 0's mask hides prefix column 5 of 10",
    ):
        gs.update(c.batch, 2)
