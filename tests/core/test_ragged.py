"""Cache-free (ragged) prefill, ``attnplug.core.ragged`` (issue 45: SGLang's MLA prefill, qk 192 / v 128):
every provider against the float32 reference on fresh random ragged batches (keys ending at each request's
last query, some requests with a cached prefix, GQA), NaN never passing; refusals name attnplug, the provider
and what it cannot run. CPU: triton under the interpreter and fa3 through its stand-in; CUDA: the libraries."""

from __future__ import annotations

import pytest
import torch
from batches import rel_err
from fa3_standin import use_fa3

from attnplug.core import UnsupportedFeature
from attnplug.core.providers import get_provider_cls
from attnplug.core.ragged import RaggedAttention, RaggedConfig, ragged_reference, ragged_refusal

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(4, 4, 192, 128), (8, 2, 64, 64), (2, 1, 128, 128)]  # (Hq, Hkv, D, Dv): DeepSeek's MHA prefill, GQA


def _case(seed: int, hq: int, hkv: int, d: int, dv: int, dtype, causal: bool = True):
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 5, (1,), generator=g))
    # query runs over one 128-row tile and cached prefixes over a 64-key block: the triton kernel's unmasked and
    # diagonal key blocks, a request's second tile
    qo = torch.randint(1, 160, (b,), generator=g)
    prefix = torch.randint(0, 150, (b,), generator=g) * (torch.rand(b, generator=g) < 0.6)
    kv = qo + prefix
    tq, tk = int(qo.sum()), int(kv.sum())

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    return qo.tolist(), kv.tolist(), rand(tq, hq, d), rand(tk, hkv, d), rand(tk, hkv, dv)


def _provider(name: str, monkeypatch):
    if name == "fa3":
        use_fa3(monkeypatch, DEVICE)
    elif name == "flashinfer" and DEVICE == "cpu":
        pytest.skip("FlashInfer runs on CUDA only (its ragged prefill runs in this test on a GPU machine)")
    return name


@pytest.mark.parametrize("provider", ["triton", "fa3", "flashinfer", "reference"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_prefill_matches_float32_reference(provider, shape, seed, monkeypatch):
    hq, hkv, d, dv = shape
    dtype = torch.bfloat16
    cls = get_provider_cls(_provider(provider, monkeypatch))
    cfg = RaggedConfig(hq, hkv, d, dv, dtype, sm_scale=0.7 / d**0.5)
    if ragged_refusal(cls, cfg):
        pytest.skip(f"{provider} refuses {shape}: {ragged_refusal(cls, cfg)} (test_ragged_refusals checks the text)")
    qo, kv, q, k, v = _case(seed, hq, hkv, d, dv, dtype)
    attn = RaggedAttention(cfg, provider, DEVICE)
    plan = attn.plan(qo, kv)
    out = torch.full((q.shape[0], hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    attn.run(q, k, v, out=out)
    ref = ragged_reference(plan, q, k, v, cfg.scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= 1e-2
    # causal is bottom-right: the last query of each request sees every key; the first, only its prefix + itself
    full = RaggedAttention(cfg, provider, DEVICE)
    full.plan(qo, kv, causal=False)
    assert rel_err(full.run(q, k, v), ragged_reference(full._plan, q, k, v, cfg.scale)) <= 1e-2


def test_ragged_reference_is_bottom_right_causal():
    """The oracle itself: one request, 2 queries over 3 keys; query 0 sees keys 0-1, query 1 all three."""
    cfg = RaggedConfig(1, 1, 16, 16, torch.float32)
    attn = RaggedAttention(cfg, "reference", "cpu")
    plan = attn.plan([2], [3])
    q = torch.zeros(2, 1, 16)
    k = torch.zeros(3, 1, 16)
    v = torch.tensor([1.0, 2.0, 3.0])[:, None, None].expand(3, 1, 16).contiguous()
    out = ragged_reference(plan, q, k, v, cfg.scale)
    assert torch.allclose(out[:, 0, 0], torch.tensor([1.5, 2.0]))


@pytest.mark.parametrize("provider", ["triton", "fa3"])
def test_ragged_kernels_reject_a_wrong_mask(provider, monkeypatch):
    """A future key must not leak: the provider's output differs from the non-causal reference wherever a
    query has keys after it."""
    cfg = RaggedConfig(2, 2, 192, 128, torch.bfloat16)
    qo, kv, q, k, v = _case(3, 2, 2, 192, 128, torch.bfloat16)
    attn = RaggedAttention(cfg, _provider(provider, monkeypatch), DEVICE)
    plan = attn.plan(qo, kv)
    out = attn.run(q, k, v)
    plan.causal = False
    assert rel_err(out, ragged_reference(plan, q, k, v, cfg.scale)) > 5e-2


def test_ragged_refusals_name_attnplug_provider_and_feature(monkeypatch):
    bad = RaggedConfig(4, 4, 160, 96, torch.bfloat16)
    for name in ("fa3", "flashinfer"):
        why = ragged_refusal(get_provider_cls(name), bad)
        assert why and "160/96" in why, why
    use_fa3(monkeypatch, "cpu")
    with pytest.raises(UnsupportedFeature, match=r"attnplug: provider 'fa3' does not support ragged prefill"):
        RaggedAttention(bad, "fa3", "cpu")
    assert "float32" in ragged_refusal(get_provider_cls("fa3"), RaggedConfig(4, 4, 192, 128, torch.float32))
    assert ragged_refusal(get_provider_cls("triton"), RaggedConfig(4, 4, 8, 8, torch.bfloat16))


def test_fa3_ragged_refused_on_a_kvcache_only_build(monkeypatch):
    """hopper / sgl_kernel builds expose ``flash_attn_with_kvcache`` as attnplug loads them: refused."""
    from attnplug.core.providers import fa3

    use_fa3(monkeypatch, "cpu")
    monkeypatch.setattr(fa3, "load_fa3", lambda: fa3.FA3Lib("sgl_kernel.flash_attn", lambda *a, **k: None, False))
    with pytest.raises(UnsupportedFeature, match=r"attnplug: provider 'fa3' .*ragged prefill through sgl_kernel"):
        RaggedAttention(RaggedConfig(4, 4, 192, 128, torch.bfloat16), "fa3", "cpu")


def test_ragged_plan_and_run_check_their_inputs():
    cfg = RaggedConfig(2, 1, 32, 16, torch.float32)
    attn = RaggedAttention(cfg, "reference", "cpu")
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(torch.zeros(1, 2, 32), torch.zeros(1, 1, 32), torch.zeros(1, 1, 16))
    with pytest.raises(ValueError, match="kv_lens >= qo_lens"):
        attn.plan([3], [2])
    attn.plan([3], [2], causal=False)
    with pytest.raises(ValueError, match="ragged k must be"):
        attn.run(torch.zeros(3, 2, 32), torch.zeros(3, 1, 32), torch.zeros(2, 1, 16))
    with pytest.raises(ValueError, match="not a multiple"):
        RaggedConfig(3, 2, 32, 32, torch.float32)
