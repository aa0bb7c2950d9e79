"""KV layouts: shapes, NHD/HND views, allocation, token scatter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnplug.core.kv_layout import KVLayout, allocate_kv_cache, from_nhd, kv_cache_shape, to_nhd, write_kv

LAYOUTS = [KVLayout.NHD, KVLayout.HND]


def test_shapes_and_string_compat():
    assert kv_cache_shape("NHD", 10, 16, 4, 64) == (10, 16, 4, 64)
    assert kv_cache_shape(KVLayout.HND, 10, 16, 4, 64) == (10, 4, 16, 64)
    assert KVLayout.HND == "HND" and KVLayout("NHD") is KVLayout.NHD
    k, v = allocate_kv_cache(3, 8, 2, 32, "HND", dtype=torch.bfloat16)
    assert k.shape == v.shape == (3, 2, 8, 32) and k.dtype == torch.bfloat16 and k.data_ptr() != v.data_ptr()
    assert not k.any()


@pytest.mark.parametrize("p", [1, 2, 16, 255, 256])
def test_page_sizes_accepted(p):
    assert kv_cache_shape("NHD", 2, p, 1, 8)[1] == p


@pytest.mark.parametrize("p", [0, -1, 257, 512, 16.0, True])
def test_page_sizes_rejected(p):
    with pytest.raises(ValueError, match="page_size"):
        kv_cache_shape("NHD", 2, p, 1, 8)


def test_bad_layout_and_dims():
    with pytest.raises(ValueError, match="layout"):
        kv_cache_shape("HDN", 2, 4, 1, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_shape("NHD", 2, 4, 0, 8)
    with pytest.raises(ValueError, match="cache must be 4-D"):
        to_nhd(torch.zeros(2, 3, 4), "NHD")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_to_nhd_is_a_view(layout):
    shape = kv_cache_shape(layout, 3, 4, 2, 5)
    cache = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    nhd = to_nhd(cache, layout)
    assert nhd.shape == (3, 4, 2, 5) and nhd.data_ptr() == cache.data_ptr()
    # element (page, offset, head, dim) is the same memory in both views
    want = cache[2, 3, 1] if layout is KVLayout.NHD else cache[2, 1, 3]
    assert torch.equal(nhd[2, 3, 1], want)
    nhd[1, 2, 0, 4] = -1.0
    assert (cache == -1).sum() == 1 and torch.equal(from_nhd(nhd, layout), cache)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(LAYOUTS),
    st.sampled_from([1, 3, 16]),
    st.sampled_from([torch.int32, torch.int64]),
    st.data(),
)
def test_write_kv_matches_loop(layout, p, idx_dtype, data):
    num_pages, h, d = 4, 2, 3
    n_slots = num_pages * p
    slots = data.draw(st.lists(st.integers(0, n_slots - 1), unique=True, max_size=min(n_slots, 20)))
    pad = data.draw(st.lists(st.integers(-3, -1), max_size=3))
    order = data.draw(st.permutations(slots + pad))
    t = len(order)
    k = torch.randn(t, h, d)
    v = torch.randn(t, h, d)
    k_cache, v_cache = allocate_kv_cache(num_pages, p, h, d, layout, dtype=torch.float32)
    write_kv(k, v, k_cache, v_cache, torch.tensor(order, dtype=idx_dtype), layout)
    ref_k = torch.zeros(num_pages, p, h, d)
    ref_v = torch.zeros(num_pages, p, h, d)
    for i, s in enumerate(order):
        if s >= 0:
            ref_k[s // p, s % p] = k[i]
            ref_v[s // p, s % p] = v[i]
    assert torch.equal(to_nhd(k_cache, layout), ref_k) and torch.equal(to_nhd(v_cache, layout), ref_v)


def test_write_kv_casts_and_validates():
    k_cache, v_cache = allocate_kv_cache(2, 4, 1, 2, "HND", dtype=torch.float16)
    k = torch.ones(2, 1, 2)
    write_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1]), "HND")
    assert k_cache[1, 0, 1].tolist() == [1.0, 1.0] and v_cache[1, 0, 1].tolist() == [2.0, 2.0]
    assert k_cache.sum() == 2 and v_cache.sum() == 4
    with pytest.raises(ValueError, match="slot_mapping must be <"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([8, 0]), "HND")
    with pytest.raises(ValueError, match="slot_mapping must be an int32 or int64"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([1.0, 0.0]), "HND")
    with pytest.raises(ValueError, match="k must have shape"):
        write_kv(k[:1], k, k_cache, v_cache, torch.tensor([1, 0]), "HND")
    with pytest.raises(ValueError, match="v_cache"):
        write_kv(k, k, k_cache, v_cache[:1], torch.tensor([1, 0]), "HND")
