"""attnplug.core.staging: the plan's host arrays reach the device through one packed buffer and one
asynchronous copy. On CPU the arrays come back as themselves; on CUDA (skipped without it) every
copy must hold its own values even when hundreds are queued behind a long kernel while the caller
overwrites its arrays, so a host buffer reused before its copy ran would show up as wrong values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.core import staging

CUDA = torch.cuda.is_available()


def _arrays(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.integers(-(2**31), 2**31 - 1, size=int(rng.integers(0, 70)), dtype=np.int32),
        rng.integers(-(2**62), 2**62, size=int(rng.integers(0, 9)), dtype=np.int64),
        rng.random(int(rng.integers(0, 33))) < 0.5,
        rng.integers(0, 256, size=int(rng.integers(1, 19)), dtype=np.uint8),
        rng.random(int(rng.integers(0, 5)), dtype=np.float32),
    ]


def test_cpu_returns_the_arrays_themselves():
    rng = np.random.default_rng(0)
    arrays = _arrays(rng)
    out = staging.to_device(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert t.device.type == "cpu" and t.shape == (a.shape[0],)
        np.testing.assert_array_equal(t.numpy(), a)
        if a.size:
            assert t.data_ptr() == a.ctypes.data  # shared, no copy


def test_layout_aligns_every_array_and_refuses_other_dtypes():
    arrays = [np.zeros(3, np.int32), np.zeros(1, np.int64), np.zeros(5, np.uint8), np.zeros(2, np.int32)]
    offsets, total = staging._layout(arrays)
    assert offsets == [0, 16, 32, 48] and total == 64
    with pytest.raises(TypeError, match="attnplug staging: dtype float16"):
        staging._layout([np.zeros(2, np.float16)])


@pytest.mark.skipif(not CUDA, reason="needs CUDA (asynchronous copies)")
def test_queued_copies_keep_their_own_values():
    dev = torch.device("cuda")
    rng = np.random.default_rng(1)
    expected, got = [], []
    torch.cuda._sleep(200_000_000)  # the copies below queue behind ~0.1 s of GPU work
    for i in range(300):  # mixed dtypes, and one dtype (the packed path) every other call
        if i % 2:
            arrays = [rng.integers(0, 9, size=int(rng.integers(0, 70)), dtype=np.int32) for _ in range(5)]
            expected.append([a.copy() for a in arrays])
            got.append(staging.to_device(arrays, dev))
            for a in arrays:
                a[...] = -7
            continue
        arrays = _arrays(rng)
        expected.append([a.copy() for a in arrays])
        got.append(staging.to_device(arrays, dev))
        for a in arrays:  # the caller may reuse its arrays at once
            a[...] = 0
    torch.cuda.synchronize()
    for exp, out in zip(expected, got):
        for a, t in zip(exp, out):
            assert t.device.type == "cuda" and t.dtype == staging._TORCH_DTYPE[a.dtype]
            np.testing.assert_array_equal(t.cpu().numpy(), a)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_make_plan_stages_its_arrays_and_the_mask_in_one_buffer():
    from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode
    from attnplug.core.plan import make_plan

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1] + [1] * 6, dtype=torch.bool)  # q 2 x kv 4, q 2 x kv 3
    batch = BatchMetadata(
        mode=ForwardMode.TARGET_VERIFY,
        qo_indptr=i32(0, 2, 4),
        kv_indptr=i32(0, 1, 2),
        kv_indices=i32(5, 3),
        kv_last_page_len=i32(4, 3),
        causal=False,
        custom_mask=mask,
    )
    plan = make_plan(AttentionConfig(4, 2, 16, 4, torch.bfloat16), batch, device="cuda")
    base = plan.qo_indptr.untyped_storage().data_ptr()
    for t in (
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_page_len,
        plan.kv_lens,
        plan.mask,
        plan.mask_indptr,
        plan.mask_free,
    ):
        assert t.is_cuda and t.untyped_storage().data_ptr() == base
    assert plan.mask.cpu().tolist() == mask.to(torch.uint8).tolist()
    assert plan.mask_free.cpu().tolist() == [3, 3] and plan.kv_lens.cpu().tolist() == [4, 3]


@pytest.mark.parametrize("seed", range(6))
def test_packed_buffer_views_are_the_arrays(seed):
    """The device path's packing and views, on a host tensor of the packed buffer: every array comes
    back with its dtype and values, all views of the one buffer (mixed dtypes, one dtype, empties)."""
    rng = np.random.default_rng(seed)
    mixes = [
        _arrays(rng),
        [rng.integers(-9, 9, size=int(rng.integers(0, 40)), dtype=np.int32) for _ in range(5)],
        [np.zeros(0, np.int32), np.zeros(0, np.int32)],
        [np.zeros(0, np.uint8), np.arange(3, dtype=np.int64)],
    ]
    for arrays in mixes:
        buf = torch.from_numpy(staging._pack(arrays))
        views = staging._views(buf, arrays)
        assert len(views) == len(arrays)
        for a, t in zip(arrays, views):
            assert t.dtype == staging._TORCH_DTYPE[a.dtype] and t.shape == (a.shape[0],)
            np.testing.assert_array_equal(t.numpy(), a)
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
