"""The vectorized host planning helpers (issue 14) against plain reference implementations: the mask's
leading visible columns (``plan._mask_free_np``) and the triton tile list (``_tile_counts`` /
``_tile_list`` / ``_stable_order``) must give the same arrays, dtypes and order on random inputs."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.core.plan import _hidden_np, _mask_free_np
from attnplug.core.providers.triton import _stable_order, _tile_counts, _tile_list

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
_ALL_TRUE_WORD = np.uint64(0x0101010101010101)


def ref_mask_free(mask: np.ndarray, mask_indptr: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """The earlier implementation of ``_mask_free_np`` (hidden bytes of the non-all-True words of the
    aligned part plus the tail, then ``np.minimum.at``)."""
    n = mask.shape[0]
    n8 = n & ~7
    free = kv_lens.astype(np.int64)
    cand = np.flatnonzero(mask[:n8].view(np.uint64) != _ALL_TRUE_WORD)
    if cand.shape[0] or n8 < n:
        pos = (cand[:, None] * 8 + np.arange(8)).ravel()
        if n8 < n:
            pos = np.concatenate((pos, np.arange(n8, n)))
        hidden = pos[~mask[pos]]
        if hidden.shape[0]:
            req = np.searchsorted(mask_indptr, hidden, side="right") - 1
            np.minimum.at(free, req, (hidden - mask_indptr[req]) % free[req])
    free[q_lens == 0] = 0
    return free.astype(np.int32)


def loop_mask_free(mask, mask_indptr, q_lens, kv_lens) -> list[int]:
    """Per request, per row: the definition (leading columns True in every row; 0 without rows)."""
    out = []
    for b in range(q_lens.shape[0]):
        q, kv = int(q_lens[b]), int(kv_lens[b])
        rows = mask[int(mask_indptr[b]) : int(mask_indptr[b]) + q * kv].reshape(q, kv)
        free = kv if q else 0
        for r in rows:
            hid = np.flatnonzero(~r)
            if hid.shape[0]:
                free = min(free, int(hid[0]))
        out.append(free)
    return out


def ref_stable_order(key: np.ndarray) -> np.ndarray:
    """The earlier ``_stable_order``: one sort of ``key << 32 | position``."""
    n = key.shape[0]
    if n >= 1 << 32 or (n and int(key[key.argmin()]) < 0):
        return np.argsort(key, kind="stable")
    packed = (key.astype(np.int64) << 32) | np.arange(n, dtype=np.int64)
    packed.sort()
    return packed & 0xFFFFFFFF


def ref_tiles(q_lens: np.ndarray, kv_lens: np.ndarray, block_q: int, prefill: bool):
    """The earlier tile list of ``TritonProvider.plan``: ``(num_tiles, tile_req, tile_q)``."""
    nreq = q_lens.shape[0]
    counts = (q_lens.astype(np.int64) + (block_q - 1)) // block_q
    ends = np.cumsum(counts)
    num_tiles = int(ends[-1])
    tile_req = np.repeat(np.arange(nreq, dtype=np.int32), counts)
    tile_q = ((np.arange(num_tiles) - (ends - counts)[tile_req]) * block_q).astype(np.int32)
    if prefill:
        order = ref_stable_order((kv_lens - q_lens)[tile_req] + tile_q)
        tile_req, tile_q = tile_req[order], tile_q[order]
    return num_tiles, tile_req, tile_q


@st.composite
def masked_batches(draw):
    """Ragged q / kv lengths (zero-length requests included), a random mask with all-True and
    all-False rows and requests, some a verify tree over a visible prefix."""
    bsz = draw(st.integers(0, 12))
    q_lens = np.array([draw(st.integers(0, 6)) for _ in range(bsz)], dtype=np.int32)
    kv_lens = np.array([q + draw(st.integers(0, 40)) for q in q_lens.tolist()], dtype=np.int32)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    blocks = []
    for q, kv in zip(q_lens.tolist(), kv_lens.tolist()):
        kind = draw(st.sampled_from(["random", "sparse", "all_true", "all_false", "tree", "rows"]))
        if kind == "random":
            m = rng.random((q, kv)) < draw(st.sampled_from([0.1, 0.5, 0.9]))
        elif kind == "sparse":  # few hidden entries anywhere (word boundaries, the tail)
            m = np.ones((q, kv), dtype=bool)
            if q * kv:
                m.flat[rng.integers(0, q * kv, draw(st.integers(1, 3)))] = False
        elif kind == "all_true":
            m = np.ones((q, kv), dtype=bool)
        elif kind == "all_false":
            m = np.zeros((q, kv), dtype=bool)
        elif kind == "tree":  # prefix visible, lower-triangular-ish tree part
            m = np.ones((q, kv), dtype=bool)
            m[:, kv - q :] = np.tril(rng.random((q, q)) < 0.6) | np.eye(q, dtype=bool)
        else:  # some rows all True, the others all False
            m = np.repeat(rng.random((q, 1)) < 0.5, kv, axis=1)
        blocks.append(m.reshape(-1))
    mask = np.concatenate(blocks) if blocks else np.zeros(0, dtype=bool)
    mask_indptr = np.zeros(bsz + 1, dtype=np.int64)
    np.cumsum(q_lens.astype(np.int64) * kv_lens, out=mask_indptr[1:])
    return mask, mask_indptr, q_lens, kv_lens


@PROPS
@given(masked_batches())
def test_mask_free_matches_reference(batch):
    mask, mask_indptr, q_lens, kv_lens = batch
    got = _mask_free_np(mask, mask_indptr, q_lens, kv_lens)
    ref = ref_mask_free(mask, mask_indptr, q_lens, kv_lens)
    assert got.dtype == np.int32 and got.shape == (q_lens.shape[0],)
    assert np.array_equal(got, ref)
    assert got.tolist() == loop_mask_free(mask, mask_indptr, q_lens, kv_lens)


@PROPS
@given(st.integers(0, 64), st.integers(0, 2**32 - 1))
def test_mask_free_single_hidden_byte_anywhere(n, seed):
    """One request of one row of ``n`` columns, at most one hidden column: every length modulo eight
    and every position of the hidden byte (aligned words, the overlapping last word, the tail)."""
    rng = np.random.default_rng(seed)
    mask = np.ones(n, dtype=bool)
    if n and rng.random() < 0.8:
        mask[rng.integers(0, n)] = False
    args = (mask, np.array([0, n], dtype=np.int64), np.array([1], dtype=np.int32), np.array([n], dtype=np.int32))
    assert np.array_equal(_mask_free_np(*args), ref_mask_free(*args))


@PROPS
@given(masked_batches())
def test_hidden_positions_are_the_false_entries(batch):
    """``_hidden_np`` lists exactly the hidden entries, ascending (every length modulo eight)."""
    mask = batch[0]
    hidden = _hidden_np(mask)
    assert hidden.dtype == np.int64 and np.array_equal(hidden, np.flatnonzero(~mask))


@PROPS
@given(
    st.lists(st.integers(-3, 70000), max_size=300),
    st.sampled_from([np.int32, np.int64]),
    st.sampled_from([4, 300, 1 << 16, 1 << 20]),
)
def test_stable_order_is_a_stable_argsort(values, dtype, modulus):
    key = np.array([v % modulus if v >= 0 else v for v in values], dtype=dtype)
    got = _stable_order(key)
    assert np.array_equal(got, np.argsort(key, kind="stable"))
    assert np.array_equal(got, ref_stable_order(key))


@PROPS
@given(
    st.lists(st.tuples(st.integers(0, 700), st.integers(0, 3000)), max_size=40),
    st.sampled_from([1, 2, 8, 16, 32, 64]),
    st.booleans(),
    st.booleans(),
)
def test_tile_list_matches_reference(reqs, block_q, prefill, wide_q):
    """Ragged q / kv lengths (zero-length requests, prefixes up to 3000 tokens, and beyond the
    16-bit keys when shifted), both orders; same counts, arrays, dtypes and order."""
    q_lens = np.array([q for q, _ in reqs], dtype=np.int64 if wide_q else np.int32)
    kv_lens = np.array([q + p + (70000 if wide_q and p % 3 == 0 else 0) for q, p in reqs], dtype=np.int32)
    if not q_lens.shape[0] or int(q_lens.sum()) == 0:
        return  # the provider takes the identity list then (no request or no token)
    counts, ends = _tile_counts(q_lens, block_q)
    num_tiles, ref_req, ref_q = ref_tiles(q_lens, kv_lens, block_q, prefill)
    assert int(ends[-1]) == num_tiles
    tile_req, tile_q = _tile_list(q_lens, kv_lens, counts, ends, block_q, prefill)
    assert tile_req.dtype == np.int32 and tile_q.dtype == np.int32
    assert np.array_equal(tile_req, ref_req) and np.array_equal(tile_q, ref_q)


def test_plan_replace_is_a_shallow_copy_with_changes():
    """``Plan.replace`` (what the fa3 tree part plans on): every other field is the same object, the
    original is unchanged, and a name that is no field raises as ``dataclasses.replace`` does."""
    import dataclasses

    import pytest
    import torch

    from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, make_plan
    from attnplug.core.providers.triton import TritonOptions

    cfg = AttentionConfig(4, 2, 64, 16, torch.bfloat16)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    plan = make_plan(cfg, BatchMetadata(ForwardMode.DECODE, i32(0, 1, 2), i32(0, 1, 3), i32(4, 0, 2), i32(5, 16)), 8)
    opts = TritonOptions(num_kv_splits=1)
    new = plan.replace(options=opts, state="s")
    assert new is not plan and new.options is opts and new.state == "s"
    assert plan.options is not opts and plan.state is None
    for f in dataclasses.fields(plan):
        if f.name not in ("options", "state"):
            assert getattr(new, f.name) is getattr(plan, f.name), f.name
    with pytest.raises(TypeError, match="no field 'optionz'"):
        plan.replace(optionz=opts)
