"""plan() never waits for the GPU: with ``torch.cuda.set_sync_debug_mode("error")`` every host-device
synchronization torch makes (a blocking copy, ``.item()``, a nonzero on the device) raises, so a
plan that would stall the host behind the kernels already queued fails here. Covered: make_plan and
the triton and fa3 providers for every forward mode (host metadata, as the adapters pass it), and
the shared-prefix (cascade) planner. FlashInfer is left out: its own ``plan()`` copies its work
lists with a blocking copy by design. Without CUDA: skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from batches import random_case
from gpu_expectations import provider_unavailable

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, ProviderUnavailable
from attnplug.core.plan import make_plan

CUDA = torch.cuda.is_available()
MODES = {
    "decode": (ForwardMode.DECODE, [1, 1, 1, 1, 1], [0, 37, 15, 130, 3000], "tree"),
    "extend": (ForwardMode.EXTEND, [7, 33, 1, 700], [0, 21, 50, 3], "tree"),
    "mixed": (ForwardMode.MIXED, [1, 40, 1, 9], [60, 5, 17, 0], "tree"),
    "verify_tree": (ForwardMode.TARGET_VERIFY, [6, 8, 4, 8], [30, 45, 0, 64], "tree"),
}
CFG = AttentionConfig(32, 8, 128, 16, torch.bfloat16)


class _NoSync:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _attn(provider: str, **kw) -> PagedAttention:
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    try:
        return PagedAttention(CFG, provider, "cuda", **kw)
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)


def test_the_guard_catches_a_blocking_copy():
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    with pytest.raises(RuntimeError, match="synchroniz"), _NoSync():
        torch.arange(4, dtype=torch.int32).to("cuda")


@pytest.mark.parametrize("mode", list(MODES))
def test_make_plan_does_not_sync(mode):
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    fmode, q_lens, prefix_lens, mask_kind = MODES[mode]
    case = random_case(fmode, q_lens, prefix_lens, CFG, "cpu", seed=5, mask_kind=mask_kind)
    with _NoSync():
        plan = make_plan(CFG, case.batch, case.num_pages, device="cuda")
    assert plan.kv_indices.is_cuda and plan.kv_indices.cpu().equal(case.batch.kv_indices)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_large_tree_mask_goes_with_the_packed_copy(dtype):
    """A verify tree over long prefixes (a host mask of >= 64 KiB) goes to the device in the plan's
    one packed copy: no sync, and the device mask holds the host mask's visibility (nonzero =
    visible) byte for byte."""
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    case = random_case(
        ForwardMode.TARGET_VERIFY, [8, 8, 8, 8], [3000, 2500, 4000, 1000], CFG, "cpu", seed=7, mask_kind="tree"
    )
    mask = case.batch.custom_mask
    assert mask.numel() >= 1 << 16 and int((~mask).sum()) > 0
    if dtype == torch.uint8:  # any nonzero byte is visible
        mask = mask.to(torch.uint8) * 3
    batch = dataclasses.replace(case.batch, custom_mask=mask)
    with _NoSync():
        plan = make_plan(CFG, batch, case.num_pages, device="cuda")
    assert plan.mask.is_cuda and plan.mask.dtype == torch.uint8
    assert torch.equal(plan.mask.cpu() != 0, mask != 0)


@pytest.mark.parametrize("provider", ["triton", "fa3"])
@pytest.mark.parametrize("mode", list(MODES))
def test_provider_plan_does_not_sync(provider, mode):
    attn = _attn(provider, cascade="off")
    fmode, q_lens, prefix_lens, mask_kind = MODES[mode]
    case = random_case(fmode, q_lens, prefix_lens, CFG, "cpu", seed=6, mask_kind=mask_kind)
    attn.plan(case.batch, num_pages=case.num_pages)  # first plan: one-time setup may sync (buffers, tables)
    with _NoSync():
        plan = attn.plan(case.batch, num_pages=case.num_pages)
    assert plan.state is not None


@pytest.mark.parametrize("provider", ["triton", "fa3"])
@pytest.mark.parametrize("mode, q_len", [(ForwardMode.DECODE, 1), (ForwardMode.EXTEND, 9)])
def test_cascade_plan_does_not_sync(provider, mode, q_len):
    attn = _attn(provider, cascade="always")
    toks = prompts([(6, 300), (3, 130)], 40, seed=2)
    batch, q, k, v, n = shared_prefix_batch(CFG, mode, toks, q_len=q_len, seed=3, device="cuda")
    attn.plan(batch, num_pages=n)
    with _NoSync():
        plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None
