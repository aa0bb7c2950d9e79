"""The Gluon prefill kernel (issue 46, ``attnplug/core/kernels/gluon_prefill.py``) on an sm90 GPU: against the
float32 reference on random ragged batches with random page tables (prefill and extend, d64 / d128 / d256, GQA
groups 1 / 4 / 8, lengths off the 128-row tile and the key block, LSE), the triton provider selecting it, and
falling back to the Triton kernels for what it does not cover (the fallbacks stay correct).

Skipped without CUDA; on a CUDA GPU that is not sm90 only the fallback test runs. On sm90 with a triton in
``GLUON_TRITON`` the kernel must be available (a missing Gluon there fails, never skips).
"""

from __future__ import annotations

import math

import pytest
import torch
from batches import fresh_provider_instances, random_case, rel_err, triton_launch
from test_gluon_plan import CASES, FALLBACKS, H200_SMS, SHAPES

from attnplug.core import AttentionConfig, ForwardMode, PagedAttention
from attnplug.core.plan import make_plan
from attnplug.core.providers.triton import GLUON_ENV, GLUON_TRITON, gluon_sm90
from attnplug.core.reference import reference_attention

CUDA = torch.cuda.is_available()
if not CUDA:
    pytest.skip("needs CUDA (no GPU here)", allow_module_level=True)
from attnplug.core.kernels import gluon_prefill  # noqa: E402 (Gluon's API: imported on CUDA machines only)

SM90 = torch.cuda.get_device_capability() == (9, 0)
REL = 1e-2
BF = torch.bfloat16


@pytest.fixture(autouse=True)
def _gluon_on(monkeypatch):
    """The kernel is on by default; ``ATTNPLUG_GLUON=1`` here keeps it on where the environment turned it off,
    with fresh provider instances."""
    monkeypatch.setenv(GLUON_ENV, "1")
    fresh_provider_instances(monkeypatch)


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


def _gluon_or_fail():
    if not SM90:
        pytest.skip("the Gluon prefill kernel is sm90 only (the fallback test covers other GPUs)")
    if not GLUON_TRITON[0] <= _triton_version() <= GLUON_TRITON[1]:
        pytest.skip(f"triton {_triton_version()} outside the Gluon kernel's supported range {GLUON_TRITON}")
    assert gluon_sm90(torch.device("cuda")), "sm90 and a supported triton, but no Gluon prefill kernel"


def _check(config: AttentionConfig, q_lens, prefix, seed=0, with_lse=True, q_view=None):
    """Plan + run the triton provider on a random case, compare with the float32 reference; the plan."""
    case = random_case(ForwardMode.EXTEND, q_lens, prefix, config, "cuda", seed=seed)
    attn = PagedAttention(config, "triton", "cuda")
    attn.provider._sms = H200_SMS  # the plans test_gluon_plan.py checks (one split: Gluon) on any GPU
    plan = attn.plan(case.batch, num_pages=case.num_pages)
    q = case.q if q_view is None else q_view(case.q)
    out = torch.full_like(case.q, math.nan)
    lse = torch.full(case.q.shape[:2], math.nan, device="cuda") if with_lse else None
    attn.run(q, case.k_cache, case.v_cache, out=out, lse=lse)
    torch.cuda.synchronize()
    whole = make_plan(config, case.batch, case.num_pages, device="cuda")
    ref, ref_lse = reference_attention(whole, case.q.float(), case.k_cache, case.v_cache)
    assert torch.isfinite(out).all(), "NaN / inf in the output"
    err = rel_err(out, ref)
    assert err <= REL, f"relative error {err:.3g} > {REL} ({config}, q {q_lens}, prefix {prefix})"
    if with_lse:
        assert torch.isfinite(lse).all() and (lse - ref_lse).abs().max().item() < 2e-2, "LSE"
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gluon_prefill_matches_reference(shape, case):
    _gluon_or_fail()
    hq, hkv, d = SHAPES[shape]
    q_lens, prefix = CASES[case]
    for seed in range(2):  # fresh random batches and page tables
        plan = _check(AttentionConfig(hq, hkv, d, 16, BF), q_lens, prefix, seed=seed, with_lse=seed == 0)
        assert triton_launch(plan)["kernel"] == "gluon", triton_launch(plan)["kernel"]


WS = [(d, c) for d, cands in gluon_prefill.WS_CANDIDATES.items() for c in cands]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("ws", WS, ids=[f"d{d}-" + "-".join(map(str, c)) for d, c in WS])
def test_gluon_ws_candidates_match_reference(ws, case, monkeypatch):
    """Each warp-specialized configuration the probe times (``WS_CANDIDATES``), planned through the table, at
    GQA groups 1 and 4 (d256: 2)."""
    _gluon_or_fail()
    d, config = ws
    monkeypatch.setitem(gluon_prefill.CONFIGS, d, config)
    q_lens, prefix = CASES[case]
    for hq, hkv in ((32, 8), (8, 8)) if d != 256 else ((16, 8),):
        plan = _check(AttentionConfig(hq, hkv, d, 16, BF), q_lens, prefix, seed=hq, with_lse=hq == 8)
        assert triton_launch(plan)["kernel"] == "gluon" and plan.state.loaders == config[5], plan.state


@pytest.mark.gpu
def test_gluon_prefill_fp16_hnd():
    _gluon_or_fail()
    plan = _check(AttentionConfig(32, 8, 128, 16, torch.float16, "HND"), [300, 129], [50, 0])
    assert triton_launch(plan)["kernel"] == "gluon"


@pytest.mark.gpu
def test_gluon_misaligned_query_falls_back():
    """A query view 2 bytes off 16-byte alignment: the run takes the Triton prefill kernel (same tiles)."""
    _gluon_or_fail()

    def shifted(q):
        store = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
        v = store[1:].view(q.shape)
        v.copy_(q)
        assert v.data_ptr() % 16 != 0
        return v

    plan = _check(AttentionConfig(32, 8, 128, 16, BF), [300, 17], [0, 40], q_view=shifted)
    assert triton_launch(plan)["kernel"] == "gluon"  # planned; the run fell back


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FALLBACKS))
def test_uncovered_features_fall_back(name):
    """Each uncovered feature plans a Triton kernel (not ``gluon``), and runs correctly."""
    config, mode, q_lens, prefix = FALLBACKS[name]
    case = random_case(mode, q_lens, prefix, config, "cuda")
    attn = PagedAttention(config, "triton", "cuda")
    plan = attn.plan(case.batch, num_pages=case.num_pages)
    assert triton_launch(plan)["kernel"] != "gluon", name
    scales = {}
    if config.kv_quantized:
        case.k_cache, case.v_cache = case.k_cache.to(config.kv_dtype), case.v_cache.to(config.kv_dtype)
        scales = dict(k_scale=torch.ones(1, device="cuda"), v_scale=torch.ones(1, device="cuda"))
    sinks = torch.randn(config.num_qo_heads, device="cuda") if config.sinks else None
    out = torch.full_like(case.q, math.nan)
    attn.run(case.q, case.k_cache, case.v_cache, out=out, sinks=sinks, **scales)
    whole = make_plan(config, case.batch, case.num_pages, device="cuda")
    ref, _ = reference_attention(
        whole, case.q.float(), case.k_cache, case.v_cache, scales.get("k_scale"), scales.get("v_scale"), sinks
    )
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= (4e-2 if config.kv_quantized else REL), name
