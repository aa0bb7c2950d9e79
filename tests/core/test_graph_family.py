"""GraphFamily: the engines' graph bookkeeping (one GraphState per layer config) and the capturable KV write."""

from __future__ import annotations

import math

import pytest
import torch
from batches import random_case, rel_err

from attnplug.core import AttentionConfig, ForwardMode, GraphFamily, UnsupportedFeature, write_kv_capturable
from attnplug.core.kv_layout import write_kv
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = 4
A = AttentionConfig(4, 2, 32, P, torch.bfloat16)
B_ = AttentionConfig(4, 2, 32, P, torch.bfloat16, logits_soft_cap=5.0)  # a second layer config


def family(**kw):
    return GraphFamily("triton", max_batch=4, max_tokens=4, max_pages=100, device=DEVICE, pad_page=0, **kw)


def check(fam, cfg, c, bs):
    T = c.batch.batch_size
    q = torch.cat([c.q, torch.randn(bs - T, *c.q.shape[1:]).to(c.q)])
    out = torch.full_like(q, math.nan)
    fam.run(cfg, bs, q, c.k_cache, c.v_cache, out)
    ref, _ = reference_attention(make_plan(cfg, c.batch, c.num_pages, device=DEVICE), c.q, c.k_cache, c.v_cache)
    assert rel_err(out[:T], ref) < 1e-2
    assert torch.isfinite(out[T:]).all()


def test_states_keyed_by_config_and_late_config_catches_up():
    fam = family().add([A])
    assert list(fam) == [A] and fam[A] is fam.state(A) and len(fam) == 1 and fam.q == 1
    c = random_case(ForwardMode.DECODE, [1, 1, 1], [5, 9, 2], A, DEVICE, seed=1)
    fam.set_batch(4, c.batch, capture=True)
    assert fam.planned(4) and not fam.planned(3)
    check(fam, A, c, 4)
    # a config first seen after the batch was written (warm-up): planned from the same host batch
    cb = random_case(ForwardMode.DECODE, [1, 1, 1], [5, 9, 2], B_, DEVICE, seed=1)
    check(fam, B_, cb, 4)
    assert set(fam) == {A, B_}
    # an in-place update of both states with a new batch
    c2 = random_case(ForwardMode.DECODE, [1, 1], [3, 11], A, DEVICE, seed=2)
    fam.set_batch(4, c2.batch)
    check(fam, A, c2, 4)


def test_late_config_from_a_block_table_refresh():
    fam = family().add([A])
    c = random_case(ForwardMode.DECODE, [1, 1], [6, 13], A, DEVICE, seed=3)
    b = c.batch
    ind = b.kv_indptr.long()
    width = int((ind[1:] - ind[:-1]).max())
    table = torch.zeros(2, width, dtype=torch.int32)
    for r in range(2):
        pages = b.kv_indices[ind[r] : ind[r + 1]]
        table[r, : pages.numel()] = pages
    seq = torch.tensor(c.kv_lens, dtype=torch.int32)
    fam.refresh_from_block_table(seq.to(DEVICE), table.to(DEVICE), 3)  # plans bs 3 where missing
    check(fam, A, c, 3)
    cb = random_case(ForwardMode.DECODE, [1, 1], [6, 13], B_, DEVICE, seed=3)
    check(fam, B_, cb, 3)


def test_refusals_go_through_refuse():
    fam = family(refuse=lambda what: UnsupportedFeature(f"attnplug: backend 'x' does not support {what}"))
    with pytest.raises(UnsupportedFeature, match="backend 'x'.*before its graph batch"):
        fam.run(A, 2, *([torch.zeros(2, 4, 32)] * 4))
    bad = GraphFamily(
        "reference",
        refuse=lambda what: UnsupportedFeature(f"attnplug: backend 'y': {what}"),
        max_batch=2,
        max_tokens=2,
        max_pages=8,
        device=DEVICE,
    )
    with pytest.raises(UnsupportedFeature, match="backend 'y': CUDA graphs here"):
        bad.add([A])


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_write_kv_capturable_equals_write_kv(kv_dtype):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([9, -1, 2, 14, 5])
    dt = kv_dtype or torch.float32
    base = torch.randn(4, 4, 2, 8, generator=g).to(dt)
    sc = torch.tensor([0.5]) if kv_dtype else None
    got_k, got_v, ref_k, ref_v = base.clone(), base.clone(), base.clone(), base.clone()
    write_kv_capturable(k, v, got_k, got_v, slots, 0, sc, sc)
    write_kv(k, v, ref_k, ref_v, slots, k_scale=sc, v_scale=sc)
    assert torch.equal(got_k.float(), ref_k.float()) and torch.equal(got_v.float(), ref_v.float())
    assert not torch.equal(got_k.float(), base.float())
