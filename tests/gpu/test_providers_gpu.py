"""Every provider (triton, flashinfer, fa3) on CUDA, every forward mode, against the float32 reference,
errors per request and head (``batches.assert_close_per_request_head``).

Skipped without CUDA. On CUDA, a configuration a provider refuses (``UnsupportedFeature``) FAILS unless
it is in ``EXPECTED_REFUSALS`` (then the refusal itself is asserted: e.g. fa3 + HND, fa3 + window +
tree mask, fa3 + a mask hiding prefix keys); a provider whose library is missing fails unless
``ATTNPLUG_GPU_OPTIONAL_PROVIDERS`` names it (``tests/gpu/gpu_expectations.py``).

FlashInfer compiles every (dtype, head_dim, window, soft-cap, backend) variant just in time (tens of
seconds each). By default only the base config (bf16, d128) runs its extends on the "fa3" template;
the other variants run them on "fa2" (decode and custom-mask verify are always fa2 kernels). Set
``ATTNPLUG_GPU_TESTS_FULL=1`` to run every variant on the default backend. Build the variants ahead
(in parallel) with ``python -m attnplug.bench.jit_warmup``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib

import pytest
import torch
from batches import assert_close_per_request_head, random_case, rel_err
from gpu_expectations import expect_refusal, provider_unavailable, unexpected_refusal

from attnplug.core import (
    AttentionConfig,
    ForwardMode,
    PagedAttention,
    ProviderUnavailable,
    UnsupportedFeature,
    make_plan,
)
from attnplug.core.providers import get_provider_cls
from attnplug.core.reference import reference_attention

CUDA = torch.cuda.is_available()
FULL = os.environ.get("ATTNPLUG_GPU_TESTS_FULL") == "1"
PROVIDERS = ["triton", "fa3", "flashinfer"]  # flashinfer last: its JIT builds can warm up meanwhile
TOL = 1e-2
LSE_TOL = 2e-2  # absolute, natural log


def _cfg(hq=8, hkv=2, d=128, page=16, dtype=torch.bfloat16, **kw):
    return AttentionConfig(hq, hkv, d, page, dtype, **kw)


# name -> (config, base flashinfer variant?)
CONFIGS = {
    "gqa4-d128-p16-bf16": (_cfg(), True),
    "gqa1-d128-p16-bf16": (_cfg(hq=4, hkv=4), True),
    "gqa8-d128-p1-bf16": (_cfg(hq=16, hkv=2, page=1), True),
    "gqa4-d128-p16-bf16-hnd": (_cfg(kv_layout="HND"), True),
    "gqa4-d64-p16-fp16": (_cfg(d=64, dtype=torch.float16), False),
    "gqa4-d128-p16-bf16-softcap30": (_cfg(logits_soft_cap=30.0), False),
    "gqa4-d128-p16-bf16-window48": (_cfg(window_left=48), False),
}

# mode name -> (ForwardMode, q_lens, prefix_lens, mask_kind); prefixes end mid-page on purpose
MODES = {
    "decode": (ForwardMode.DECODE, [1, 1, 1, 1, 1], [0, 37, 15, 130, 64], "tree"),
    "extend": (ForwardMode.EXTEND, [7, 33, 1, 70], [0, 21, 50, 3], "tree"),
    "mixed": (ForwardMode.MIXED, [1, 40, 1, 9], [60, 5, 17, 0], "tree"),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [2, 3, 4, 1], [40, 17, 100, 9], "tree"),
    "verify_tree": (ForwardMode.TARGET_VERIFY, [6, 8, 4, 8], [30, 45, 0, 64], "tree"),
    "verify_random_mask": (ForwardMode.TARGET_VERIFY, [5, 8], [19, 40], "random"),
}


# (provider, config name, mode) -> regex of the refusal: configurations refused ON PURPOSE. Any other
# refusal fails; a listed one must still be refused (its test asserts it).
FA3_HND = r"provider 'fa3' does not support kv_layout='HND'"
EXPECTED_REFUSALS = {("fa3", "gqa4-d128-p16-bf16-hnd", m): FA3_HND for m in MODES}
EXPECTED_REFUSALS[("fa3", "gqa4-d128-p16-bf16-window48", "verify_tree")] = (
    r"provider 'fa3' does not support a custom \(tree\) mask together with a sliding window"
)
for _name in CONFIGS:  # FA3 computes the prefix without a mask (the window refusal comes first there)
    EXPECTED_REFUSALS.setdefault(
        ("fa3", _name, "verify_random_mask"), r"sliding window" if "window" in _name else r"hides part of the prefix"
    )


def _attn(provider: str, config: AttentionConfig, key=None) -> PagedAttention:
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    try:
        return PagedAttention(config, provider, "cuda")
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    except UnsupportedFeature as e:
        unexpected_refusal(key or (provider, config), e)


def _plan_kwargs(provider: str, base: bool) -> dict:
    return {"prefill_backend": "fa2"} if provider == "flashinfer" and not (base or FULL) else {}


def _check(attn: PagedAttention, case, plan_kwargs: dict, key=None) -> None:
    try:
        plan = attn.plan(case.batch, num_pages=case.num_pages, **plan_kwargs)
    except UnsupportedFeature as e:
        unexpected_refusal(key or attn.provider_name, e)
    attn.check_inputs(case.q, case.k_cache, case.v_cache)
    hq = case.config.num_qo_heads
    out = torch.full_like(case.q, math.nan)
    lse = torch.full((case.q.shape[0], hq), math.nan, dtype=torch.float32, device="cuda")
    attn.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = reference_attention(plan, case.q, case.k_cache, case.v_cache)
    assert not torch.isnan(out).any(), "NaN in output"
    err = rel_err(out, ref)
    assert err <= TOL, f"output relative L2 error {err:.2e} > {TOL}"
    assert_close_per_request_head(
        out, ref, case.batch.qo_indptr, case.config.dtype, f"{attn.provider_name} vs reference"
    )
    fin = torch.isfinite(ref_lse)
    assert not torch.isnan(lse[fin]).any(), "NaN in LSE"
    lerr = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    assert lerr <= LSE_TOL, f"LSE max abs error {lerr:.2e} (natural log expected)"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_provider_matches_reference(provider, cfg_name, mode):
    config, base = CONFIGS[cfg_name]
    fmode, q_lens, prefix_lens, mask_kind = MODES[mode]
    key = (provider, cfg_name, mode)
    seed = zlib.crc32(f"{cfg_name}/{mode}".encode()) % 10_000
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    case = random_case(fmode, q_lens, prefix_lens, config, "cuda", seed=seed, mask_kind=mask_kind)
    if key in EXPECTED_REFUSALS:  # refused on purpose: the refusal (at construction or plan) is the result
        try:
            get_provider_cls(provider).check_available(torch.device("cuda"))
        except ProviderUnavailable as e:
            provider_unavailable(provider, e)
        with expect_refusal(EXPECTED_REFUSALS, key):
            PagedAttention(config, provider, "cuda").plan(
                case.batch, num_pages=case.num_pages, **_plan_kwargs(provider, base)
            )
        return
    attn = _attn(provider, config, key)
    _check(attn, case, _plan_kwargs(provider, base), key)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
def test_llama3_shape_verify_and_decode(provider):
    """The benchmark's shape (32/8 heads, d128, page 16) at small batch: decode + 64-token tree verify."""
    config = _cfg(hq=32, hkv=8)
    attn = _attn(provider, config)
    for fmode, q_lens, prefix_lens in (
        (ForwardMode.DECODE, [1] * 3, [300, 1000, 17]),
        (ForwardMode.TARGET_VERIFY, [64, 64], [500, 129]),
    ):
        _check(attn, random_case(fmode, q_lens, prefix_lens, config, "cuda", seed=7), {})


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
def test_large_host_tree_mask_matches_reference(provider):
    """A tree verify over long prefixes with host metadata (as the adapters pass it): its 84 KB mask
    goes to the device in make_plan's packed copy and every provider's output equals the reference."""
    config = _cfg(hq=32, hkv=8)
    attn = _attn(provider, config)
    case = random_case(ForwardMode.TARGET_VERIFY, [8] * 4, [3000, 2500, 4000, 1000], config, "cuda", seed=13)
    host = {
        f.name: getattr(case.batch, f.name).cpu()
        for f in dataclasses.fields(case.batch)
        if isinstance(getattr(case.batch, f.name), torch.Tensor)
    }
    assert host["custom_mask"].numel() >= 1 << 16
    case.batch = dataclasses.replace(case.batch, **host)
    _check(attn, case, {})


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_nan_in_unused_cache_slots_does_not_leak(provider, page):
    """Engines leave garbage (even NaN) in free pages and past each request's last token."""
    config = _cfg(page=page)
    attn = _attn(provider, config)
    case = random_case(ForwardMode.MIXED, [1, 20, 5], [30, 7, 40], config, "cuda", seed=11)
    b = case.batch
    used = torch.zeros(case.num_pages, dtype=torch.bool)
    used[b.kv_indices.long()] = True
    case.k_cache[~used.cuda()] = math.nan
    case.v_cache[~used.cuda()] = math.nan
    for r in range(b.batch_size):
        last_page = int(b.kv_indices[int(b.kv_indptr[r + 1]) - 1])
        n = int(b.kv_last_page_len[r])
        case.k_cache[last_page, n:] = math.nan
        case.v_cache[last_page, n:] = math.nan
    _check(attn, case, {})


@pytest.mark.gpu
def test_fa3_refuses_prefix_mask():
    config = _cfg()
    attn = _attn("fa3", config)
    case = random_case(ForwardMode.TARGET_VERIFY, [5, 8], [19, 40], config, "cuda", seed=1, mask_kind="random")
    with pytest.raises(UnsupportedFeature, match="prefix"):
        attn.plan(case.batch, num_pages=case.num_pages)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_run_is_graph_capturable(provider, mode):
    """``run`` does no host work: it can be captured in a CUDA graph and replayed with new q."""
    config = _cfg()
    attn = _attn(provider, config)
    fmode, q_lens, prefix_lens, _ = MODES[mode]
    case = random_case(fmode, q_lens, prefix_lens, config, "cuda", seed=3)
    plan = attn.plan(case.batch, num_pages=case.num_pages)
    q = case.q.clone()
    out = torch.empty_like(q)
    attn.run(q, case.k_cache, case.v_cache, out=out)  # warm up (JIT / autotune) outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, case.k_cache, case.v_cache, out=out)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = reference_attention(plan, q, case.k_cache, case.v_cache)
    assert rel_err(out, ref) <= TOL


@pytest.mark.gpu
def test_flashinfer_merge_state_natural_log():
    attn = _attn("flashinfer", _cfg())
    t, h, d = 37, 8, 128
    va, vb = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sa, sb = (torch.randn(t, h, device="cuda") * 3 for _ in range(2))
    v, s = attn.provider.merge_state(va, sa, vb, sb)
    ref_s = torch.logaddexp(sa, sb)
    wa, wb = torch.exp(sa - ref_s)[..., None], torch.exp(sb - ref_s)[..., None]
    assert rel_err(v, va.float() * wa + vb.float() * wb) <= TOL
    assert float((s - ref_s).abs().max()) <= 1e-3


@pytest.mark.parametrize("provider", ["flashinfer", "fa3"])
def test_unavailable_on_cpu_says_how_to_fix(provider):
    with pytest.raises(ProviderUnavailable, match="pip install"):
        get_provider_cls(provider).check_available(torch.device("cpu"))


@pytest.mark.parametrize("provider", ["flashinfer", "fa3"])
def test_refuses_float32(provider):
    if not CUDA:
        pytest.skip("needs CUDA (no GPU here)")
    cls = get_provider_cls(provider)
    try:
        cls.check_available(torch.device("cuda"))
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    with pytest.raises(UnsupportedFeature, match="float32"):
        PagedAttention(_cfg(dtype=torch.float32), provider, "cuda")


def test_plan_is_the_core_plan():
    """Smoke (CPU): the cases used above are valid core plans."""
    for fmode, q_lens, prefix_lens, kind in MODES.values():
        case = random_case(fmode, q_lens, prefix_lens, _cfg(), "cpu", seed=0, mask_kind=kind)
        make_plan(case.config, case.batch, num_pages=case.num_pages)


def test_expected_refusals_are_cases_and_match_the_providers_messages():
    """CPU check of ``EXPECTED_REFUSALS`` (so the H200 run cannot fail on a stale list): every key is a
    parametrized case, and the provider refuses it with a matching message. fa3 cannot be built here
    (no GPU): the instance is the tests' FA3 stand-in provider (``fa3_standin.fa3_on_cpu``: no
    availability check or library loading, the provider's own state as ``__init__`` sets it);
    ``check_config`` and ``plan`` run for real on CPU tensors up to the refusal."""
    from fa3_standin import fa3_on_cpu

    for key, pattern in EXPECTED_REFUSALS.items():
        provider, cfg_name, mode = key
        assert provider in PROVIDERS and cfg_name in CONFIGS and mode in MODES, key
        assert provider == "fa3", f"{key}: this check knows how to build fa3 only"
        config, _ = CONFIGS[cfg_name]
        fmode, q_lens, prefix_lens, mask_kind = MODES[mode]
        case = random_case(fmode, q_lens, prefix_lens, config, "cpu", seed=0, mask_kind=mask_kind)
        prov = fa3_on_cpu(config, "cpu")
        with pytest.raises(UnsupportedFeature, match=pattern):
            prov.check_config(config)
            prov.plan(make_plan(config, case.batch, num_pages=case.num_pages, device="cpu"))
    # and the cases not listed are not refused by those checks (fa3, every config and mode)
    for cfg_name, (config, _) in CONFIGS.items():
        for mode, (fmode, q_lens, prefix_lens, mask_kind) in MODES.items():
            if ("fa3", cfg_name, mode) in EXPECTED_REFUSALS:
                continue
            prov = fa3_on_cpu(config, "cpu")
            prov.check_config(config)
            if mask_kind == "random" or fmode == ForwardMode.TARGET_VERIFY:
                case = random_case(fmode, q_lens, prefix_lens, config, "cpu", seed=0, mask_kind=mask_kind)
                prov.check_tree_config()
                pl = make_plan(config, case.batch, num_pages=case.num_pages, device="cpu")
                assert bool((pl.mask_free_cpu >= pl.kv_lens_cpu - pl.q_lens_cpu).all()), (cfg_name, mode)
