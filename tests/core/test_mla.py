"""MLA (issue 45): the absorbed kernels against a float32 reference computed WITHOUT absorption (from
up-projected K/V), every mode, on random ragged batches and random page tables; the config, cache views,
latent write and the provider contract's refusals."""

from __future__ import annotations

import pytest
import torch
from batches import rel_err
from mla_cases import MLACase
from mla_cases import mla_case as _mla_case

from attnplug.core import BatchMetadata, ForwardMode, PagedAttention, UnsupportedFeature
from attnplug.core.config import AttentionConfig
from attnplug.core.mla import check_mla_support, latent_cache_views, mla_config, mla_reference, write_latent
from attnplug.core.plan import make_plan
from attnplug.core.providers import get_provider_cls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a CUDA machine compiles the kernels instead


def mla_case(*args, **kw) -> MLACase:
    return _mla_case(*args, device=DEVICE, **kw)


D, V, TV, E = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND


def _batch(c: MLACase) -> BatchMetadata:
    p = c.plan
    mask = p.mask.bool() if p.mask is not None else None
    return BatchMetadata(
        p.mode,
        p.qo_indptr_cpu,
        p.kv_indptr_cpu,
        p.kv_indices_cpu,
        p.kv_last_page_len_cpu,
        custom_mask=mask,
        causal=p.causal,
    )


def _run(c: MLACase, provider: str = "triton", cascade: str = "off", lse: bool = False, k_scale=None, **knobs):
    attn = PagedAttention(c.plan.config, provider=provider, device=c.q.device, cascade=cascade)
    attn.plan(_batch(c), num_pages=c.cache.shape[0], **knobs)
    T, H = c.q.shape[:2]
    out = torch.full((T, H, c.plan.config.head_dim_v), float("nan"), dtype=c.q.dtype, device=DEVICE)
    s = torch.full((T, H), float("nan"), device=DEVICE) if lse else None
    scales = {"k_scale": k_scale} if k_scale is not None else {}
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=s, **scales)
    return attn, out, s


def _share_first_pages(c: MLACase, n: int) -> tuple[BatchMetadata, torch.Tensor]:
    """``c``'s batch with every request's first ``n`` pages replaced by request 0's (a shared prefix), and
    the unabsorbed reference of that batch."""
    p = c.plan
    idx, ind = p.kv_indices_cpu.clone(), p.kv_indptr_cpu.tolist()
    for b in range(1, p.batch_size):
        idx[ind[b] : ind[b] + n] = idx[ind[0] : ind[0] + n]
    mask = p.mask.bool() if p.mask is not None else None
    batch = BatchMetadata(p.mode, p.qo_indptr_cpu, p.kv_indptr_cpu, idx, p.kv_last_page_len_cpu, custom_mask=mask)
    plan = make_plan(p.config, batch, num_pages=c.cache.shape[0], device="cpu")
    return batch, mla_reference(plan, c.q_nope, c.q_pe, c.cache.cpu(), c.w_uk, c.w_uv.cpu()).to(DEVICE)


def _check(c: MLACase, out: torch.Tensor, tol: float = 1e-2) -> None:
    assert not out.isnan().any(), "NaN in the MLA output"
    up = c.up(out)
    err = rel_err(up, c.ref)
    assert err <= tol, f"relative error {err:.3g} > {tol}"
    # per request: one wrong request cannot hide in the whole batch's norm
    qo = c.plan.qo_indptr_cpu.tolist()
    for b in range(len(qo) - 1):
        if qo[b + 1] > qo[b]:
            e = rel_err(up[qo[b] : qo[b + 1]], c.ref[qo[b] : qo[b + 1]])
            assert e <= 2 * tol, f"request {b}: relative error {e:.3g}"


CASES = {
    "decode": (D, [1, 1, 1, 1], [5, 40, 17, 0], "tree"),
    "chain_verify": (V, [4, 3, 4], [9, 30, 0], "chain"),
    "tree_verify": (TV, [5, 4], [21, 3], "tree"),
    "prefill": (E, [7, 20, 3], [0, 0, 0], "tree"),
    "extend": (E, [7, 20, 3, 1], [13, 40, 2, 9], "tree"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_mla_matches_unabsorbed_reference(name, dtype):
    mode, q_lens, prefix, kind = CASES[name]
    for seed in (0, 1):
        c = mla_case(mode, q_lens, prefix, dtype=dtype, seed=seed, mask_kind=kind)
        _, out, _ = _run(c)
        _check(c, out, 1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("name", ["decode", "extend", "tree_verify"])
def test_reference_provider_mla(name):
    mode, q_lens, prefix, kind = CASES[name]
    c = mla_case(mode, q_lens, prefix, dtype=torch.float32, mask_kind=kind)
    _, out, _ = _run(c, provider="reference")
    _check(c, out, 1e-5)


@pytest.mark.parametrize("name", ["decode", "chain_verify", "extend"])
def test_triton_mla_split_kv_and_lse(name):
    """Forced splits (merge of partials) equal the unsplit run, LSE included."""
    mode, q_lens, prefix, kind = CASES[name]
    c = mla_case(mode, q_lens, [p + 60 for p in prefix], dtype=torch.float32, mask_kind=kind, seed=3)
    _, o1, l1 = _run(c, lse=True)
    _, o3, l3 = _run(c, lse=True, num_kv_splits=3)
    _check(c, o3, 1e-4)
    assert torch.allclose(o1, o3, atol=1e-5) and torch.allclose(l1, l3, atol=1e-5)
    _, ref_o, ref_l = _run(c, provider="reference", lse=True)
    assert torch.allclose(l3, ref_l, atol=1e-4)


def test_triton_mla_decode_heads_a_program():
    """Decode's ``block_m`` knob sets the heads a program (its rows): 16 of 40 heads in three programs, the
    last one part empty, against the un-absorbed reference."""
    c = mla_case(D, [1, 1, 1], [70, 5, 300], heads=40, mask_kind="tree", seed=5)
    attn, out, _ = _run(c, block_m=16)
    assert attn.current_plan.state.block_h == 16  # the default: 64 (next power of two of 40, at most 64)
    _check(c, out)


@pytest.mark.parametrize(
    "heads, rank, want",
    [  # (requests, keys) -> splits on 132 SMs
        (16, 512, {(64, 4096): 4, (1, 32768): 64, (4, 32768): 64, (128, 2048): 2, (1, 1000): 1, (200, 4096): 1}),
        (128, 512, {(64, 4096): 1, (1, 32768): 64, (4, 32768): 16, (8, 4096): 8, (66, 4096): 1}),
        (16, 64, {(64, 4096): 5, (1, 32768): 128}),  # a small latent: two programs an SM, one split per 256 keys
    ],
)
def test_triton_mla_decode_split_counts(heads, rank, want):
    """A large latent's decode splits: the fewest (a power of two, one per 512 keys at most) whose programs
    fill whole waves, one program an SM with 64 heads a program, two with fewer; its decode tiles."""
    prov = get_provider_cls("triton")(mla_config(heads, rank, 64 if rank > 128 else 16), torch.device(DEVICE))
    prov._sms = 132
    got = {k: prov.split_count(*k) for k in want}
    assert got == want
    assert prov._mla_tiles(1)[1:] == (
        (64, 64, 8, 3) if heads == 128 else (16, 32, 8, 2) if rank > 128 else (16, 64, 4, 2)
    )


def test_triton_mla_deepseek_shape():
    """R=512, Dr=64 (the DeepSeek latent), 16 heads: decode and a short chain verify."""
    for mode, q_lens, prefix, kind in ((D, [1, 1], [70, 5], "tree"), (V, [2], [33], "chain")):
        c = mla_case(mode, q_lens, prefix, heads=16, rank=512, rope=64, nope=128, page_size=64, mask_kind=kind)
        _, out, _ = _run(c)
        _check(c, out)


@pytest.mark.parametrize("cascade", ["always"])
def test_triton_mla_cascade(cascade):
    """Requests that share their first pages: the cascade (prefix read once, LSE merge) equals the
    reference."""
    c = mla_case(D, [1, 1, 1], [40, 40, 40], dtype=torch.float32, seed=5)
    p = c.plan
    batch, ref = _share_first_pages(c, 2)
    attn = PagedAttention(p.config, provider="triton", device=DEVICE, cascade=cascade)
    plan2 = attn.plan(batch, num_pages=c.cache.shape[0])
    assert plan2.cascade is not None, "the cascade did not cut the shared prefix"
    out = attn.run(c.q, c.k_cache, c.v_cache)
    assert not out.isnan().any()
    assert rel_err(c.up(out), ref) <= 1e-4


def test_fp8_latent_cache():
    """An fp8 latent (e4m3, one k_scale) dequantized on load equals the reference on the stored values."""
    scale = torch.tensor([0.5], device=DEVICE)
    c = mla_case(D, [1, 1, 1], [30, 3, 17], kv_dtype=torch.float8_e4m3fn, k_scale=0.5, seed=2)
    _, out, _ = _run(c, k_scale=scale)
    _check(c, out)
    c = mla_case(V, [3, 2], [20, 9], kv_dtype=torch.float8_e4m3fn, k_scale=0.5, seed=2, mask_kind="tree")
    _, out, _ = _run(c, k_scale=scale)
    _check(c, out)


def test_write_latent_and_views():
    cfg = mla_config(4, 64, 16, page_size=8, dtype=torch.float32)
    cache = torch.zeros(5, 8, 80, device=DEVICE)
    kv_c, k_pe = torch.randn(4, 64, device=DEVICE), torch.randn(4, 1, 16, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 39], device=DEVICE)
    write_latent(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, 80)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], torch.cat([kv_c[t], k_pe[t, 0]]))
    assert flat[[i for i in range(40) if i not in (3, 17, 39)]].abs().sum() == 0, "a padding slot was written"
    k, v = latent_cache_views(cache, cfg)
    assert k.shape == (5, 8, 1, 80) and v.shape == (5, 8, 1, 64) and v.data_ptr() == k.data_ptr()
    with pytest.raises(ValueError, match="attnplug"):
        latent_cache_views(torch.zeros(5, 8, 64), cfg)


def test_fp8_write_latent_roundtrip():
    cache = torch.zeros(2, 4, 80, dtype=torch.float8_e4m3fn, device=DEVICE)
    kv_c, k_pe = torch.randn(3, 64, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    write_latent(kv_c, k_pe, cache, torch.tensor([0, 5, 7], device=DEVICE), k_scale=torch.tensor([0.25], device=DEVICE))
    got = cache.view(-1, 80)[[0, 5, 7]].float() * 0.25
    want = (torch.cat([kv_c, k_pe], 1) / 0.25).to(torch.float8_e4m3fn).float() * 0.25
    assert torch.equal(got, want)


def test_mla_config_and_refusals():
    cfg = mla_config(16)
    assert cfg.is_mla and cfg.kv_lora_rank == 512 and cfg.rope_dim == 64 and cfg.head_dim == 576
    assert cfg.num_kv_heads == 1 and not AttentionConfig(8, 8, 64, 16).is_mla
    with pytest.raises(UnsupportedFeature, match="attnplug: MLA .* soft cap"):
        AttentionConfig(4, 1, 80, 16, logits_soft_cap=30.0, head_dim_v=64)
    with pytest.raises(UnsupportedFeature, match="sliding window"):
        AttentionConfig(4, 1, 80, 16, window_left=8, head_dim_v=64)
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        AttentionConfig(4, 2, 80, 16, head_dim_v=64)
    for name in ("triton", "flashinfer", "fa3", "reference"):
        assert get_provider_cls(name).supports_mla()
    check_mla_support("triton", mla_config(16, kv_dtype=torch.float8_e4m3fn))


def test_provider_without_mla_refuses():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from toy_provider import ToyProvider  # a provider with no MLA_IMPL

    assert not ToyProvider.supports_mla()
    with pytest.raises(UnsupportedFeature, match="attnplug: provider .* does not support MLA"):
        ToyProvider(mla_config(4, 64, 16, page_size=16, dtype=torch.float32), torch.device("cpu"))


def test_run_refuses_a_v_cache_that_is_not_the_latent_view():
    c = mla_case(D, [1, 1], [5, 9], dtype=torch.float32)
    attn = PagedAttention(c.plan.config, provider="triton", device=DEVICE, cascade="off")
    attn.plan(_batch(c))
    with pytest.raises(ValueError, match="v_cache must be k_cache"):
        attn.check_inputs(c.q, c.k_cache, c.v_cache.clone())
    attn.check_inputs(c.q, c.k_cache, c.v_cache)


@pytest.mark.parametrize("name", list(CASES))
def test_fa3_mla_on_the_standin(name, monkeypatch):
    """The fa3 provider's MLA class (FA3's ``qv`` call; tree verify: FA3 prefix + the Triton MLA tree part,
    LSE-merged) on CPU through the FA3 stand-in; tests/gpu/test_mla_gpu.py runs the real FA3."""
    from fa3_standin import use_fa3

    use_fa3(monkeypatch, DEVICE)
    mode, q_lens, prefix, kind = CASES[name]
    c = mla_case(mode, q_lens, prefix, rank=512, rope=64, nope=64, page_size=16, mask_kind=kind, seed=7)
    attn, out, lse = _run(c, provider="fa3", lse=True)
    assert type(attn.provider).__name__ == "FA3MLAProvider"
    _check(c, out)
    _, _, ref_lse = _run(c, provider="reference", lse=True)
    assert torch.allclose(lse, ref_lse, atol=2e-2)


def test_fa3_mla_cascade_on_the_standin(monkeypatch):
    from fa3_standin import use_fa3

    use_fa3(monkeypatch, DEVICE)
    c = mla_case(D, [1, 1, 1], [40, 40, 40], rank=512, rope=64, nope=64, seed=5)
    p = c.plan
    batch, ref = _share_first_pages(c, 2)
    attn = PagedAttention(p.config, provider="fa3", device=DEVICE, cascade="always")
    assert attn.plan(batch, num_pages=c.cache.shape[0]).cascade is not None
    out = attn.run(c.q, c.k_cache, c.v_cache)
    assert not out.isnan().any() and rel_err(c.up(out), ref) <= 1e-2


def test_mla_refusals_of_the_library_providers():
    """flashinfer / fa3 refuse what their MLA kernels cannot compute, naming attnplug, the provider and the
    feature."""
    fa3_fp8 = "attnplug: provider 'fa3' does not support an MLA latent cache of float8_e4m3fn"
    with pytest.raises(UnsupportedFeature, match=fa3_fp8):
        check_mla_support("fa3", mla_config(16, kv_dtype=torch.float8_e4m3fn))
    from attnplug.core.providers.fa3_mla import FA3MLAProvider

    fp8 = mla_config(16, kv_dtype=torch.float8_e4m3fn)  # the constructor's check (no GPU here) says the same
    with pytest.raises(UnsupportedFeature, match=fa3_fp8 + r" \(it reads: bfloat16, float16\)"):
        object.__new__(FA3MLAProvider).check_kv_dtype(fp8)
    with pytest.raises(UnsupportedFeature, match="'flashinfer' does not support MLA with kv_lora_rank 64"):
        check_mla_support("flashinfer", mla_config(16, 64, 16))
    with pytest.raises(UnsupportedFeature, match="provider 'fa3' does not support MLA in torch.float32"):
        check_mla_support("fa3", mla_config(16, dtype=torch.float32))
    check_mla_support("flashinfer", mla_config(16))
    from attnplug.core.providers.flashinfer_mla import FlashInferMLAProvider

    g = FlashInferMLAProvider.graph_support
    assert g.decode and not g.device_refresh


@pytest.mark.parametrize("provider", ["triton", "fa3"])
@pytest.mark.parametrize(
    "mode, cascade", [("decode", "off"), ("decode", "always"), ("verify", "off"), ("chain", "off")]
)
def test_mla_graph_state(provider, mode, cascade, monkeypatch):
    """GraphState (CUDA-graph static buffers, replayed here without capture) over MLA: padded batches of every
    captured size equal the unabsorbed reference on their real rows."""
    from attnplug.core.cuda_graph import GraphState

    if provider == "fa3":
        from fa3_standin import use_fa3

        use_fa3(monkeypatch, DEVICE)
    big = provider == "fa3"
    q = 1 if mode == "decode" else 3
    fm = D if mode == "decode" else V
    kw = dict(rank=512, rope=64, nope=64) if big else {}
    cfg = mla_case(D, [1], [3], **kw).plan.config
    gs = GraphState(
        cfg,
        provider,
        max_batch=3,
        max_tokens=3 * q,
        max_pages=40,
        device=DEVICE,
        mode="decode" if mode == "decode" else "verify",
        num_draft_tokens=q,
        cascade=cascade,
        chain=mode == "chain",
        max_seq_len=160,
    )
    for bs in (1, 2, 3):
        gs.prepare_capture(bs)
    for B, bs, seed in ((1, 1, 0), (2, 3, 1), (3, 3, 2)):
        prefix = [20 + 9 * b for b in range(B)]
        c = mla_case(fm, [q] * B, prefix, mask_kind="chain" if mode == "chain" else "tree", seed=seed, **kw)
        # cascade: a shared first page, which the cascade part cuts
        batch, ref = _share_first_pages(c, 1) if cascade != "off" else (_batch(c), c.ref)
        gs.update(batch, bs)
        qp = torch.zeros(bs * q, *c.q.shape[1:], dtype=c.q.dtype, device=DEVICE)
        qp[: B * q] = c.q
        out = torch.full((bs * q, c.q.shape[1], cfg.head_dim_v), float("nan"), dtype=c.q.dtype, device=DEVICE)
        gs.run(bs, qp, c.k_cache, c.v_cache, out)
        assert not out[: B * q].isnan().any()
        err = rel_err(c.up(out[: B * q]), ref)
        assert err <= 1e-2, f"bs={bs} B={B}: {err:.3g}"


def test_bench_mla_rows_quick(tmp_path):
    """``python -m attnplug.bench --quick``'s MLA rows: attnplug's triton provider is checked against the
    float32 reference and timed; the library MLA kernels report why they do not run here."""
    import json

    from attnplug.bench.__main__ import main

    assert main(["--quick", "--rows", "MLA", "--providers", "triton,fa3", "--no-ceilings", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    recs = json.loads(path.read_text())["rows"]
    tri = [r for r in recs if r["impl"] == "attnplug.triton"]
    assert {r["row"] for r in tri} == {"MLA decode 4x100 h4", "MLA prefill 2x48 h4"}
    assert all(r["status"] == "ok" and r["err"] < 1e-2 for r in tri), tri
    libs = {r["impl"]: r["status"] for r in recs if r["row"] == "MLA decode 4x100 h4" and r["library"]}
    assert libs.keys() >= {"fa3.mla_qv", "flashmla"} and all(
        s.startswith(("n/a", "unavailable")) for s in libs.values()
    ), libs


def test_mla_multi_step_draft():
    """MultiStepDraftPlanner over an MLA config (token view of the latent cache): every step's triton run
    equals the float32 reference on the same step batch."""
    from test_graph_draft_oracles import draft_case

    from attnplug.core.draft import MultiStepDraftPlanner, token_config, token_view

    seq_lens, topk, steps = [37, 0, 70], 2, 2
    ind, idx, last, draft, num_pages = draft_case(seq_lens, 16, topk, steps, seed=3)
    cfg = mla_config(4, 64, 16, page_size=16, dtype=torch.float32)
    cache = torch.randn(num_pages, 16, 80, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    k, v = latent_cache_views(cache, cfg)
    planner = MultiStepDraftPlanner(cfg, topk, steps, max_batch=3, provider="triton", device=DEVICE)
    planner.plan(ind, idx, last, draft, num_pages=num_pages)
    tc = token_config(cfg)
    for i, batch in enumerate(planner.step_batches(ind, idx, last, draft)):
        q = torch.randn(len(seq_lens) * topk, 4, 80, device=DEVICE)
        got = planner.run(i, q, k, v, torch.full((q.shape[0], 4, 64), float("nan"), device=DEVICE))
        ref = PagedAttention(tc, provider="reference", device=DEVICE)
        ref.plan(batch)
        want = ref.run(q, token_view(k, cfg), token_view(v, cfg))
        assert not got.isnan().any() and rel_err(got, want) <= 1e-4, i
