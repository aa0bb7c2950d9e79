"""Cascade (shared-prefix) attention through every provider on the GPU, against the float32
reference of the whole batch (skipped with a reason without CUDA; a provider that cannot run a
case must say so in ``EXPECTED_REFUSALS``, anything else refused fails)."""

from __future__ import annotations

import math

import pytest
import torch

from attnplug.bench.shared_prefix import prompts, shared_prefix_batch
from attnplug.core import AttentionConfig, ForwardMode, PagedAttention, ProviderUnavailable, make_plan
from attnplug.core.reference import reference_attention

pytestmark = pytest.mark.gpu

# (provider, mode) -> why it refuses; everything not listed must run
EXPECTED_REFUSALS: dict[tuple[str, ForwardMode], str] = {}

CASES = [
    (ForwardMode.DECODE, 1, [(16, 700)], 40, 0, 0),
    (ForwardMode.DECODE, 1, [(5, 300), (7, 520)], 33, 0, 3),
    (ForwardMode.DECODE, 1, [(4, 200), (4, 200)], 17, 96, 1),  # nested prefixes
    (ForwardMode.TARGET_VERIFY, 6, [(6, 400)], 21, 0, 2),
    (ForwardMode.EXTEND, 9, [(3, 256), (2, 130)], 50, 0, 0),
]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("provider", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode, q_len, groups, unique, nested, loners", CASES)
def test_cascade_equals_reference_gpu(provider, page, mode, q_len, groups, unique, nested, loners):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU here)")
    cfg = AttentionConfig(32, 8, 128, page, torch.bfloat16)
    try:
        attn = PagedAttention(cfg, provider, "cuda", cascade="always")
    except ProviderUnavailable as e:
        pytest.skip(f"provider {provider!r} unavailable: {e}")
    if (provider, mode) in EXPECTED_REFUSALS:
        pytest.skip(EXPECTED_REFUSALS[(provider, mode)])
    toks = prompts(groups + [(1, 0)] * loners, unique, nested=nested, seed=page + q_len)
    batch, q, k, v, n = shared_prefix_batch(cfg, mode, toks, q_len=q_len, seed=3, device="cuda")
    plan = attn.plan(batch, num_pages=n)
    assert plan.cascade is not None
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], cfg.num_qo_heads), math.nan, device="cuda")
    attn.run(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    whole = make_plan(cfg, batch, n, device="cuda")
    ref, ref_lse = reference_attention(whole, q, k, v)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for b in range(whole.batch_size):
        lo, hi = int(whole.qo_indptr_cpu[b]), int(whole.qo_indptr_cpu[b + 1])
        assert rel(out[lo:hi], ref[lo:hi]) <= 1e-2, (b, rel(out[lo:hi], ref[lo:hi]))
    assert rel(lse, ref_lse) <= 1e-3


def test_triton_prefix_part_launches_as_a_programmatic_dependent_on_hopper(monkeypatch):
    """On sm90+ the triton provider launches its cascade graphs' prefix part as a programmatic dependent of
    the suffix part (``attnplug.core.kernels.pdl``), so the GPU runs of ``tests/core/test_cascade_graph.py``
    test that path; ``ATTNPLUG_PDL=0`` turns it off."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU here)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    from attnplug.core.providers.triton import TritonProvider

    cfg, dev = AttentionConfig(32, 8, 128, 16, torch.bfloat16), torch.device("cuda")
    assert TritonProvider(cfg, dev)._pdl()
    monkeypatch.setenv("ATTNPLUG_PDL", "0")
    assert not TritonProvider(cfg, dev)._pdl()
