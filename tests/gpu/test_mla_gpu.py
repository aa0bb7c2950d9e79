"""MLA (issue 45) on CUDA: triton, fa3 (qv path) and flashinfer (BatchMLAPagedAttentionWrapper) against the
float32 reference computed WITHOUT absorption (``tests/core/mla_cases.py``), DeepSeek's latent (512 + 64,
q_nope 128), 16 and 128 query heads, every mode, split-KV lengths, cascade, fp8 latent (triton), and
CUDA-graph capture / replay through GraphState. Relative error <= 1e-2, no NaN.

Skipped without CUDA. Refusals are listed (:data:`EXPECTED`); any other refusal fails.

    bash scripts/gpu_run.sh python -m pytest tests/gpu/test_mla_gpu.py -q -rs
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from batches import rel_err
from gpu_expectations import expect_refusal, provider_unavailable, unexpected_refusal
from mla_cases import MLACase, mla_case

from attnplug.core import BatchMetadata, ForwardMode, PagedAttention, ProviderUnavailable, UnsupportedFeature
from attnplug.core.cuda_graph import GraphState
from attnplug.core.mla import latent_cache_views, mla_config, write_latent

CUDA = torch.cuda.is_available()
if not CUDA:
    pytest.skip("needs CUDA (no GPU here)", allow_module_level=True)
PROVIDERS = ["triton", "fa3", "flashinfer"]
D, V, E = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND
MODES = {  # name -> (mode, q_lens, prefix_lens, mask kind)
    "decode": (D, [1] * 6, [0, 37, 300, 4100, 1500, 64], "tree"),
    "decode_long": (D, [1], [32767], "tree"),  # split-KV
    "prefill": (E, [300, 17, 129], [0, 0, 0], "tree"),
    "extend": (E, [7, 33, 1, 70], [0, 210, 50, 3000], "tree"),
    "verify_chain": (V, [4, 4, 4], [200, 9, 1000], "chain"),
    "verify_tree": (V, [6, 8, 4], [300, 45, 640], "tree"),
}
TREE = r"provider 'flashinfer' does not support tree-masked verify with MLA"
EXPECTED = {
    ("flashinfer", "verify_tree"): TREE,
    ("flashinfer", "graph_tree"): "provider 'flashinfer' does not support CUDA graphs of tree-masked",
    ("fa3", "fp8"): "provider 'fa3' does not support an MLA latent cache",
    ("flashinfer", "fp8"): "provider 'flashinfer' does not support an MLA latent cache",
}
REL = 1e-2


@functools.lru_cache(maxsize=8)
def _case(name: str, heads: int, seed: int = 0, **kw) -> MLACase:
    mode, q_lens, prefix, kind = MODES[name]
    return mla_case(
        mode,
        q_lens,
        prefix,
        heads=heads,
        rank=512,
        rope=64,
        nope=128,
        page_size=64,
        mask_kind=kind,
        seed=seed,
        device="cuda",
        **kw,
    )


def _batch(c: MLACase, chain: bool = False) -> BatchMetadata:
    """The case's batch; ``chain``: a linear draft as the engines send it (causal, no custom mask)."""
    p = c.plan
    mask = p.mask.bool().cpu() if p.mask is not None and not chain else None
    return BatchMetadata(
        p.mode,
        p.qo_indptr_cpu,
        p.kv_indptr_cpu,
        p.kv_indices_cpu,
        p.kv_last_page_len_cpu,
        custom_mask=mask,
        causal=p.causal or chain,
    )


def _attn(provider: str, cfg, cascade: str = "off"):
    try:
        return PagedAttention(cfg, provider, "cuda", cascade=cascade)
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)


def _check(c: MLACase, out: torch.Tensor) -> None:
    assert not out.isnan().any(), "NaN in the MLA output"
    err = rel_err(c.up(out).cpu(), c.ref.cpu())
    assert err <= REL, f"relative error {err:.3g}"


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_mla_matches_unabsorbed_reference(provider, name, heads):
    c = _case(name, heads)
    attn = _attn(provider, c.plan.config)
    if (provider, name) in EXPECTED:
        with expect_refusal(EXPECTED, (provider, name)):
            attn.plan(_batch(c), num_pages=c.cache.shape[0])
        return
    try:
        attn.plan(_batch(c, chain=name == "verify_chain"), num_pages=c.cache.shape[0])
    except UnsupportedFeature as e:
        unexpected_refusal((provider, name), e)
    out = torch.full((c.q.shape[0], heads, 512), math.nan, dtype=c.q.dtype, device="cuda")
    lse = torch.full(c.q.shape[:2], math.nan, device="cuda")
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse)
    _check(c, out)
    ref = _attn("reference", c.plan.config)
    ref.plan(_batch(c), num_pages=c.cache.shape[0])
    ref_lse = torch.empty_like(lse)
    ref.run(c.q, c.k_cache, c.v_cache, lse=ref_lse)
    assert torch.allclose(lse, ref_lse, atol=5e-2), (lse - ref_lse).abs().max()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_mla_cascade(provider):
    """Requests sharing their first 1024 latent tokens: the cascade reads them once, LSE-merged."""
    c = _case("decode", 16, seed=3)
    p = c.plan
    idx, ind = p.kv_indices_cpu.clone(), p.kv_indptr_cpu.tolist()
    long = max(range(p.batch_size), key=lambda b: ind[b + 1] - ind[b])
    share = [b for b in range(p.batch_size) if ind[b + 1] - ind[b] > 16]
    for b in share:
        idx[ind[b] : ind[b] + 16] = idx[ind[long] : ind[long] + 16]
    batch = BatchMetadata(D, p.qo_indptr_cpu, p.kv_indptr_cpu, idx, p.kv_last_page_len_cpu)
    attn = _attn(provider, p.config, cascade="always")
    plan = attn.plan(batch, num_pages=c.cache.shape[0])
    if len(share) > 1:
        assert plan.cascade is not None
    out = attn.run(c.q, c.k_cache, c.v_cache)
    ref = _attn("reference", p.config, cascade="off")
    ref.plan(batch, num_pages=c.cache.shape[0])
    want = ref.run(c.q, c.k_cache, c.v_cache)
    assert not out.isnan().any() and rel_err(out.float(), want.float()) <= REL


@pytest.mark.parametrize("provider", PROVIDERS)
def test_mla_fp8_latent(provider):
    """An e4m3 latent cache with one k_scale: triton dequantizes on load; fa3 / flashinfer refuse it."""
    cfg = mla_config(16, page_size=64, kv_dtype=torch.float8_e4m3fn)
    if (provider, "fp8") in EXPECTED:
        with expect_refusal(EXPECTED, (provider, "fp8")):
            PagedAttention(cfg, provider, "cuda")
        return
    c = _case("decode", 16, kv_dtype=torch.float8_e4m3fn, k_scale=0.25)
    attn = _attn(provider, c.plan.config)
    attn.plan(_batch(c), num_pages=c.cache.shape[0])
    out = attn.run(c.q, c.k_cache, c.v_cache, k_scale=torch.tensor([0.25], device="cuda"))
    _check(c, out)


@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_mla_cuda_graphs(provider, mode):
    """GraphState capture, then replays of fresh batches of smaller sizes padded into it."""
    heads, q = 16, (1 if mode == "decode" else 4)
    cfg = mla_config(heads, page_size=64, sm_scale=(128 + 64) ** -0.5)
    key = (provider, "graph_tree") if mode == "verify_tree" else None
    try:
        gs = GraphState(
            cfg,
            provider,
            max_batch=4,
            max_tokens=4 * q,
            max_pages=400,
            device="cuda",
            mode="decode" if mode == "decode" else "verify",
            num_draft_tokens=q,
            chain=mode == "verify_chain",
            max_seq_len=4096,
        )
    except ProviderUnavailable as e:
        provider_unavailable(provider, e)
    except UnsupportedFeature as e:
        if key in EXPECTED:
            with expect_refusal(EXPECTED, key):
                raise
            return
        unexpected_refusal((provider, mode), e)
    assert key not in EXPECTED, f"{key}: expected a refusal"
    bs = 4
    gs.prepare_capture(bs)
    fm = D if mode == "decode" else V
    kind = "chain" if mode == "verify_chain" else "tree"
    c0 = mla_case(
        fm, [q] * bs, [100] * bs, heads=heads, rank=512, rope=64, nope=128, page_size=64, mask_kind=kind, device="cuda"
    )
    qbuf = torch.zeros(bs * q, heads, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(bs * q, heads, 512, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(400, 64, 576, dtype=torch.bfloat16, device="cuda")
    k, v = latent_cache_views(cache, cfg)
    gs.update(_batch(c0), bs)
    gs.run(bs, qbuf, k, v, out)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gs.run(bs, qbuf, k, v, out)
    for B, seed in ((2, 1), (4, 2), (3, 3)):
        c = mla_case(
            fm,
            [q] * B,
            [50 + 700 * b for b in range(B)],
            heads=heads,
            rank=512,
            rope=64,
            nope=128,
            page_size=64,
            mask_kind=kind,
            seed=seed,
            device="cuda",
        )
        n = c.cache.shape[0]
        cache[:n].copy_(c.cache)
        qbuf.zero_()
        qbuf[: B * q].copy_(c.q)
        out.fill_(math.nan)
        gs.update(_batch(c), bs)
        g.replay()
        torch.cuda.synchronize()
        _check(c, out[: B * q])


def test_write_latent_cuda():
    cache = torch.zeros(8, 64, 576, dtype=torch.bfloat16, device="cuda")
    kv_c = torch.randn(5, 512, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.randn(5, 1, 64, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, 77, -1, 200, 511], device="cuda")
    write_latent(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, 576)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], torch.cat([kv_c[t], k_pe[t, 0]]))
