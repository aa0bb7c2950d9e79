"""The triton provider's Hopper paths, forced through its tile table, against the float32 reference:
the causal prefill kernel (``kernels/prefill.py``: mask-free blocks + masked diagonal, longest-first
tile order, per-key page gather or tensor-descriptor pages) and the split-KV decode kernel
(``kernels/decode.py``: unmasked stream, ragged tail, fused last-arriver merge with self-resetting
counters), plus the table plumbing (bucket choice, split policy, seeds = the 2026-11-29 behaviour).

On CPU these run under the Triton interpreter; on a CUDA machine compiled. The provider's SM count is
set to the H200's 132 so the decode buckets and split counts are the GPU's.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from batches import assert_close_per_request_head, fresh_provider_instances, random_case, rel_err, triton_launch

from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, PagedAttention
from attnplug.core.cuda_graph import GraphState
from attnplug.core.kernels import tiles
from attnplug.core.kv_layout import quantize_fp8
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H200_SMS = 132


@pytest.fixture(autouse=True)
def _triton_kernels(monkeypatch):
    """These tests pin the Triton kernels through the tile table: on an sm90 GPU the Gluon prefill, which the
    table does not steer, is turned off (``ATTNPLUG_GLUON=0``, fresh provider instances)."""
    monkeypatch.setenv("ATTNPLUG_GLUON", "0")
    fresh_provider_instances(monkeypatch)


@contextlib.contextmanager
def table(entries: dict):
    """Tile-table entries in force inside the block (the rest of the table unchanged)."""
    saved = dict(tiles.TILES)
    tiles.TILES.update(entries)
    try:
        yield
    finally:
        tiles.TILES.clear()
        tiles.TILES.update(saved)


def run_case(c, entries, lse_too=True, scales=None, sms=H200_SMS, **plan_kwargs):
    """Plan + run ``c`` with ``entries`` in the table on a GPU of ``sms`` SMs (default the H200's); compare with
    the reference; return the plan."""
    with table(entries):
        attn = PagedAttention(c.config, "triton", DEVICE)
        attn.provider._sms = sms
        plan = attn.plan(c.batch, num_pages=c.num_pages, **plan_kwargs)
    lse = torch.full((c.q.shape[0], c.config.num_qo_heads), math.nan, device=DEVICE) if lse_too else None
    out = torch.full_like(c.q, math.nan)
    attn.run(c.q, c.k_cache, c.v_cache, out=out, lse=lse, **(scales or {}))
    sc = (scales["k_scale"], scales["v_scale"]) if scales else ()
    ref, ref_lse = reference_attention(plan, c.q, c.k_cache, c.v_cache, *sc)  # fp8: on the dequantized cache
    assert not torch.isnan(out).any(), "NaN in output"
    tol = None
    if scales:  # V spans ~+-10 there: abs scaled to the values (as tests/core/test_fp8.py)
        t = {torch.bfloat16: dict(rel=2e-2, abs=4e-2), torch.float16: dict(rel=4e-3, abs=4e-3)}[c.config.dtype]
        tol = dict(rel=t["rel"], abs=t["abs"] * max(1.0, float(ref.abs().max())))
    assert_close_per_request_head(out, ref, c.batch.qo_indptr, c.config.dtype, "fast path vs reference", tol)
    if lse_too:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), "LSE finiteness differs from reference"
        assert rel_err(lse[fin], ref_lse[fin]) <= 1e-4
    return plan


def cfg(hq=8, hkv=2, d=64, page=16, dtype=torch.bfloat16, **kw):
    return AttentionConfig(hq, hkv, d, page, dtype, **kw)


def prefill_entry(c, **kw):
    e = {"kernel": "prefill", "block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 3}
    e.update(kw)
    return {tiles.key(c.head_dim, c.group_size, "prefill"): e}


# ---- prefill kernel ---------------------------------------------------------------------------
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("page,dtype,group", [(1, BF16, 4), (16, FP32, 1), (16, BF16, 4), (64, BF16, 1), (64, FP32, 4)])
def test_prefill_ragged(page, dtype, group):
    """Ragged extends over cached prefixes (prefix 0 = plain prefill), random page tables, tiles
    ending mid-request, a one-token request (its tile is mostly padding rows)."""
    c = random_case(
        ForwardMode.EXTEND,
        [37, 70, 1, 19],
        [0, 50, 33, 130],
        cfg(2 * group, 2, page=page, dtype=dtype),
        DEVICE,
        seed=page + group,
    )
    plan = run_case(c, prefill_entry(c.config, block_m=max(16, 4 * group)))
    launch = triton_launch(plan)
    assert launch["kernel"] == "prefill" and launch["num_splits"] == 1 and launch["num_tiles"] > 4
    # the tile list ascends in causal work (the kernel runs it backwards: longest first, whole batch)
    req, q0 = plan.state.tile_req.cpu(), plan.state.tile_qstart.cpu()
    work = torch.tensor([k - q for k, q in zip(c.kv_lens, c.q_lens)])[req.long()] + q0
    assert bool((work[1:] >= work[:-1]).all()) and sorted(zip(req.tolist(), q0.tolist())) == sorted(
        set(zip(req.tolist(), q0.tolist()))
    )


@pytest.mark.parametrize("block_n,diag_n", [(32, 32), (32, 16), (64, 16), (32, 0), (64, 0)])
def test_prefill_blocks_and_diagonal(block_n, diag_n):
    """Whole mask-free blocks, then a diagonal loop with smaller blocks; key counts that are not a
    multiple of either (the last block of the diagonal is partly past kv_len). ``diag_n`` 0: one loop,
    the causal mask behind a branch on the diagonal blocks."""
    c = random_case(ForwardMode.EXTEND, [93, 64, 7], [0, 61, 200], cfg(8, 2, d=64), DEVICE, seed=block_n + diag_n)
    plan = run_case(c, prefill_entry(c.config, block_m=64, block_n=block_n, diag_n=diag_n))
    assert triton_launch(plan)["kernel"] == "prefill"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page,block_n", [(64, 32), (32, 32)])
def test_prefill_tensor_descriptor_pages(layout, page, block_n):
    """Page size a multiple of block_n: K/V blocks through 4-D tensor descriptors (TMA on Hopper)."""
    c = random_case(
        ForwardMode.EXTEND, [45, 80], [0, 100], cfg(8, 2, d=64, page=page, kv_layout=layout), DEVICE, seed=page
    )
    plan = run_case(c, prefill_entry(c.config, block_m=64, block_n=block_n, tma=True))
    assert plan.state.tma and triton_launch(plan)["kernel"] == "prefill"


@pytest.mark.parametrize("d", [80, 256])
def test_prefill_head_dims(d):
    c = random_case(ForwardMode.EXTEND, [40, 9], [3, 70], cfg(4, 2, d=d, dtype=torch.float16), DEVICE, seed=d)
    plan = run_case(c, prefill_entry(c.config, block_m=32, block_n=16))
    assert triton_launch(plan)["kernel"] == "prefill"


@pytest.mark.parametrize(
    "kv_dtype,f16", [(torch.float8_e4m3fn, False), (torch.float8_e5m2, False), (torch.float8_e4m3fn, True)]
)
def test_prefill_fp8_kv(kv_dtype, f16):
    """fp8 KV: dequantized on load, k_scale in the softmax scale, v_scale on the output; ``f16``: the
    table's fp8 entry asks for fp16 dots on q * scale (a large-valued query)."""
    base = cfg(8, 2, d=64)
    c = random_case(ForwardMode.EXTEND, [50, 20], [10, 90], base, DEVICE, seed=5)
    if f16:
        c.q = c.q * 1000
    ks, vs = torch.tensor([4 / 100], device=DEVICE), torch.tensor(3 / 60, device=DEVICE)
    c.k_cache = quantize_fp8(c.k_cache.float() * 4, ks, kv_dtype)
    c.v_cache = quantize_fp8(c.v_cache.float() * 3, vs, kv_dtype)
    c.config = cfg(8, 2, d=64, kv_dtype=kv_dtype)
    e = prefill_entry(c.config, block_m=32, block_n=16)
    if f16:
        e = {k + "/fp8": dict(v, fp8_f16=True) for k, v in e.items()}
    plan = run_case(c, e, scales={"k_scale": ks, "v_scale": vs})
    assert triton_launch(plan)["kernel"] == "prefill" and plan.state.fp8_f16 == f16


def planned_kernel(config, batch, entries, **plan_kwargs) -> dict:
    """The triton launch choices for ``batch`` with ``entries`` in the table (plan only, no run)."""
    with table(entries):
        attn = PagedAttention(config, "triton", DEVICE)
        attn.provider._sms = H200_SMS
        return triton_launch(attn.plan(batch, num_pages=int(batch.kv_indices.max()) + 1, **plan_kwargs))


def lengths_batch(mode, q_lens, kv_lens, page=16) -> BatchMetadata:
    """Metadata only (identity page table), for plan-level checks of large shapes."""
    n = [-(-k // page) for k in kv_lens]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return BatchMetadata(
        mode,
        i32([0] + q_lens).cumsum(0).to(torch.int32),
        i32([0] + n).cumsum(0).to(torch.int32),
        torch.arange(sum(n), dtype=torch.int32),
        i32([(k - 1) % page + 1 for k in kv_lens]),
    )


def test_prefill_kernel_only_where_it_applies():
    """Window, soft cap, a custom mask, kv_start or a split keep the general kernel."""
    b = lengths_batch(ForwardMode.EXTEND, [40, 30], [40, 90])
    for kw in ({"window_left": 20}, {"logits_soft_cap": 30.0}, {}):
        c = cfg(8, 2, **kw)
        assert planned_kernel(c, b, prefill_entry(c))["kernel"] == ("prefill" if not kw else "paged")
    assert planned_kernel(cfg(8, 2), b, prefill_entry(cfg(8, 2)), num_kv_splits=2)["kernel"] == "paged"
    kv_start = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert planned_kernel(cfg(8, 2), b, prefill_entry(cfg(8, 2)), kv_start=kv_start)["kernel"] == "paged"
    c = random_case(ForwardMode.TARGET_VERIFY, [8, 8], [40, 9], cfg(8, 2), DEVICE, seed=2)
    assert planned_kernel(c.config, c.batch, prefill_entry(c.config))["kernel"] == "paged"


# ---- decode kernel ------------------------------------------------------------------------------
def decode_entries(c, fused=True, **kw):
    e = {"kernel": "decode", "block_n": 32, "num_warps": 4, "num_stages": 3, "fused_merge": fused}
    e.update(kw)
    return {tiles.key(c.head_dim, c.group_size, b): dict(e) for b in ("decode", "decode_split", "decode_tiny")}


@pytest.mark.parametrize("fused,page,dtype", [(True, 1, BF16), (True, 16, FP32), (False, 16, BF16), (False, 1, FP32)])
def test_decode_split(fused, page, dtype):
    """Long ragged contexts split over programs (ends not on block or chunk boundaries), merged in the
    kernel by the last split (``fused``) or by merge_splits; counters are zero after the launch."""
    c = random_case(ForwardMode.DECODE, [1] * 3, [40, 1499, 3001], cfg(8, 2, page=page, dtype=dtype), DEVICE, seed=page)
    plan = run_case(c, decode_entries(c.config, fused, ctas_per_sm=1))
    launch = triton_launch(plan)
    assert launch["kernel"] == "decode" and launch["num_splits"] > 1
    if fused:
        assert plan.state.counters is not None and not plan.state.counters.any()


@pytest.mark.parametrize("group", [1, 8])
def test_decode_groups_and_forced_splits(group):
    c = random_case(ForwardMode.DECODE, [1] * 4, [0, 37, 16, 300], cfg(2 * group, 2, d=32), DEVICE, seed=group)
    for splits in (1, 5):
        plan = run_case(c, decode_entries(c.config), num_kv_splits=splits)
        assert triton_launch(plan)["num_splits"] == splits and triton_launch(plan)["kernel"] == "decode"


@pytest.mark.parametrize("kw", [{"window_left": 50}, {"logits_soft_cap": 20.0}, {"kv_layout": "HND"}])
def test_decode_window_softcap_layout(kw):
    c = random_case(ForwardMode.DECODE, [1] * 3, [10, 700, 1200], cfg(8, 2, **kw), DEVICE, seed=7)
    plan = run_case(c, decode_entries(c.config), num_kv_splits=3)
    assert triton_launch(plan)["kernel"] == "decode"


def test_decode_fp8_kv():
    base = cfg(8, 2, d=64)
    c = random_case(ForwardMode.DECODE, [1] * 3, [10, 700, 1200], base, DEVICE, seed=8)
    ks, vs = torch.tensor([4 / 100], device=DEVICE), torch.tensor(3 / 60, device=DEVICE)
    c.k_cache = quantize_fp8(c.k_cache.float() * 4, ks, torch.float8_e4m3fn)
    c.v_cache = quantize_fp8(c.v_cache.float() * 3, vs, torch.float8_e4m3fn)
    c.config = cfg(8, 2, d=64, kv_dtype=torch.float8_e4m3fn)
    plan = run_case(c, decode_entries(c.config), scales={"k_scale": ks, "v_scale": vs}, num_kv_splits=4)
    assert triton_launch(plan)["kernel"] == "decode"


@pytest.mark.parametrize("kernel,kv_dtype", [("decode", torch.float8_e4m3fn), ("paged", torch.float8_e5m2)])
def test_fp8_f16_dots(kernel, kv_dtype):
    """fp8 entries with ``fp8_f16`` (fp16 dots on q * scale) in the decode and the paged kernel, split
    and not, on a query of large values (|q| ~ 3000); fp8 caches fall back to the 16-bit entries; a
    16-bit cache never reads the fp8 ones."""
    base = cfg(8, 2, d=64)
    c = random_case(ForwardMode.DECODE, [1] * 3, [10, 700, 1200], base, DEVICE, seed=9)
    c.q = c.q * 3000
    ks, vs = torch.tensor([4 / 100], device=DEVICE), torch.tensor(3 / 60, device=DEVICE)
    c.k_cache = quantize_fp8(c.k_cache.float() * 4, ks, kv_dtype)
    c.v_cache = quantize_fp8(c.v_cache.float() * 3, vs, kv_dtype)
    c.config = cfg(8, 2, d=64, kv_dtype=kv_dtype)
    e = (
        decode_entries(c.config, block_n=32)
        if kernel == "decode"
        else {
            tiles.key(64, 4, b): {"kernel": "paged", "block_n": 32, "num_warps": 4, "num_stages": 2}
            for b in ("decode", "decode_split", "decode_tiny")
        }
    )
    fp8_e = {k + "/fp8": dict(v, fp8_f16=True) for k, v in e.items()}
    for splits in (1, 4):
        plan = run_case(c, {**e, **fp8_e}, scales={"k_scale": ks, "v_scale": vs}, num_kv_splits=splits)
        assert triton_launch(plan)["kernel"] == kernel and plan.state.fp8_f16
    plan = run_case(c, {k: dict(v, fp8_f16=True) for k, v in e.items()}, scales={"k_scale": ks, "v_scale": vs})
    assert plan.state.fp8_f16  # fp8 falls back to the 16-bit entry, whose fields apply
    c16 = random_case(ForwardMode.DECODE, [1] * 3, [10, 700, 1200], base, DEVICE, seed=9)
    assert not run_case(c16, {**e, **fp8_e}).state.fp8_f16  # a 16-bit cache never reads the /fp8 entries


@pytest.mark.parametrize(
    "kv_dtype,f16,page,kw",
    [
        (torch.float8_e4m3fn, True, 16, {}),
        (torch.float8_e5m2, True, 1, {}),
        (torch.float8_e4m3fn, False, 16, {}),
        (torch.float8_e4m3fn, True, 16, {"window_left": 300}),
        (torch.float8_e5m2, True, 16, {"logits_soft_cap": 20.0}),
        (torch.float8_e4m3fn, True, 16, {"kv_layout": "HND"}),
    ],
)
def test_decode_fp8_pairs(kv_dtype, f16, page, kw):
    """fp8 K/V read as 16-bit byte pairs (the ``pairs`` entry field: even / odd dims, two accumulators)
    against the reference, split (fused merge) and not, with NaN bytes in the cache slots past each
    request's keys (the masked tail block must not read them into a product); a large-valued query
    for the fp16 dots."""
    base = cfg(8, 2, d=64, page=page, **kw)
    c = random_case(ForwardMode.DECODE, [1] * 3, [10, 700, 1203], base, DEVICE, seed=11)
    c.q = c.q * 300
    ks, vs = torch.tensor([4 / 100], device=DEVICE), torch.tensor(3 / 60, device=DEVICE)
    c.k_cache = quantize_fp8(c.k_cache.float() * 4, ks, kv_dtype)
    c.v_cache = quantize_fp8(c.v_cache.float() * 3, vs, kv_dtype)
    c.config = cfg(8, 2, d=64, page=page, kv_dtype=kv_dtype, **kw)
    hnd = kw.get("kv_layout") == "HND"
    b = c.batch
    # page 0 (where masked page-id loads point) all NaN, unused: the caches shift up one page
    c.k_cache, c.v_cache = (torch.cat([torch.full_like(x[:1], float("nan")), x]) for x in (c.k_cache, c.v_cache))
    b.kv_indices += 1
    c.num_pages += 1
    for r in range(3):  # NaN past each request's last key (its last page's free slots)
        last = int(b.kv_indices[int(b.kv_indptr[r + 1]) - 1])
        used = int(b.kv_last_page_len[r])
        for cache in (c.k_cache, c.v_cache):
            if hnd:
                cache[last, :, used:] = float("nan")
            else:
                cache[last, used:] = float("nan")
    e = decode_entries(c.config, block_n=32)
    fp8_e = {k + "/fp8": dict(v, fp8_f16=f16, pairs=True) for k, v in e.items()}
    for splits in (1, 4):
        plan = run_case(c, {**e, **fp8_e}, scales={"k_scale": ks, "v_scale": vs}, num_kv_splits=splits)
        assert triton_launch(plan)["kernel"] == "decode" and plan.state.pairs and plan.state.fp8_f16 == f16


def test_decode_under_graph_state():
    """GraphState with the fused decode: static counters, padded replays equal eager, counters stay 0."""
    c0 = cfg(4, 2, d=32, page=16)
    with table(decode_entries(c0)):
        gs = GraphState(
            c0,
            "triton",
            max_batch=4,
            max_tokens=4,
            max_pages=300,
            device=DEVICE,
            mode="decode",
            pad_page=3,
            num_kv_splits=3,
        )
        plan = gs.prepare_capture(3)
    assert triton_launch(plan)["kernel"] == "decode" and plan.state.counters is not None
    for B, seed in ((2, 1), (3, 2)):
        c = random_case(ForwardMode.DECODE, [1] * B, [40 * seed, 500, 90][:B], c0, DEVICE, seed=seed, extra_pages=4)
        c.k_cache[3], c.v_cache[3] = 0.5, 0.25
        with table(decode_entries(c0)):
            assert gs.update(c.batch, 3) is plan
        q = torch.cat([c.q, torch.randn(3 - B, *c.q.shape[1:]).to(c.q)])
        out = torch.full_like(q, math.nan)
        gs.run(3, q, c.k_cache, c.v_cache, out)
        ref, _ = reference_attention(make_plan(c0, c.batch, c.num_pages, device=DEVICE), c.q, c.k_cache, c.v_cache)
        assert rel_err(out[:B], ref) < 1e-2
        assert torch.isfinite(out[B:]).all()
        assert not plan.state.counters.any()


def test_decode_short_replay_of_long_capture():
    """A decode graph planned for 8 splits replayed on contexts that fill 1 to 5 of them (chunks of
    ``BLOCK_N`` keys): the splits past a request's keys neither write nor get merged (their partials
    hold NaN here, which would show), the last active split merges, counters are 0 after each run."""
    c0 = cfg(8, 2, d=32, page=16)
    with table(decode_entries(c0)):
        gs = GraphState(
            c0,
            "triton",
            max_batch=4,
            max_tokens=4,
            max_pages=200,
            device=DEVICE,
            mode="decode",
            pad_page=3,
            num_kv_splits=8,
        )
        plan = gs.prepare_capture(4)
    assert triton_launch(plan)["num_splits"] == 8 and plan.state.counters is not None
    for seed, lens in ((1, [40, 70, 300, 1]), (2, [1, 33, 64, 129])):
        c = random_case(ForwardMode.DECODE, [1] * 4, lens, c0, DEVICE, seed=seed, extra_pages=4)
        with table(decode_entries(c0)):
            assert gs.update(c.batch, 4) is plan
        plan.state.partial.fill_(math.nan)
        plan.state.partial_lse.fill_(math.nan)
        out = torch.full_like(c.q, math.nan)
        gs.run(4, c.q, c.k_cache, c.v_cache, out)
        ref, _ = reference_attention(make_plan(c0, c.batch, c.num_pages, device=DEVICE), c.q, c.k_cache, c.v_cache)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2
        assert not plan.state.counters.any()


@pytest.mark.parametrize(
    "kv_dtype,rows,kv_len,want",
    [
        (None, 1, 1024, 8),
        (None, 1, 2048, 16),
        (None, 4, 1024, 2),
        (None, 4, 2048, 4),
        (None, 1, 32768, 17),
        (torch.float8_e4m3fn, 1, 1024, 8),
        (torch.float8_e4m3fn, 4, 1024, 2),
        (torch.float8_e4m3fn, 4, 2048, 4),
        (None, 64, 4096, 1),
        (None, 1, 1000, 1),
        (None, 4, 32768, 8),
        (None, 12, 8192, 4),
        (None, 13, 8192, 3),
        (None, 6, 16384, 5),
        (None, 16, 16384, 2),
        (None, 2, 32768, 16),
    ],
)
def test_split_rule_of_short_contexts(kv_dtype, rows, kv_len, want):
    """The split count on the H200's 132 SMs (Llama-3-8B attention, the committed table): one split per
    128 keys for decode_tiny batches, per 512 for decode_split (16-bit: the decode kernel's 128-key
    blocks, 2 x 4096 0.0212 ms at 8 splits against 0.0251 for the paged kernel at 17; fp8: the
    2026-12-03 eager rows), capped by the programs per SM: 16-bit decode_split in whole waves of two
    an SM (4 x 32768: 8 splits, 256 programs, not 9), or three where two leave a fifth of the slots idle
    (12 x 8192: 96 programs, 2 splits fill 73%, 4 splits 97%); full batches and < 1024 keys do not split."""
    prov = PagedAttention(AttentionConfig(32, 8, 128, 16, BF16, kv_dtype=kv_dtype), "triton", DEVICE).provider
    prov._sms = H200_SMS
    assert prov.split_count(rows, kv_len) == want


def test_full_batch_splits_when_its_entry_asks():
    """A batch that fills the SMs (``decode`` bucket) runs unsplit unless its entry names
    ``ctas_per_sm``; then it splits like the split buckets (programs per SM, one split per 128 keys)."""
    prov = PagedAttention(
        AttentionConfig(32, 8, 128, 16, BF16, kv_dtype=torch.float8_e4m3fn), "triton", DEVICE
    ).provider
    prov._sms = H200_SMS
    key = tiles.key(128, 4, "decode", fp8=True)
    assert prov.split_count(64, 4096) == 1
    with table({key: {"kernel": "decode", "block_n": 64, "ctas_per_sm": 8, "fused_merge": True}}):
        assert prov.split_count(64, 4096) == 3  # 8 * 132 programs over 512
        assert prov.split_count(64, 300) == 1 and prov.split_count(64, 1024) == 3
        assert prov.split_count(512, 4096) == 1  # 4096 programs already


@pytest.mark.parametrize(
    "tiles_,ctas,per_sm,want",
    [(2, None, 2, 16), (2, 1, 1, 8), (2, 3, 3, 24), (1, None, 1, 16), (4, None, 2, 8), (32, None, None, 1)],
)
def test_cascade_prefix_splits_fill_whole_waves(tiles_, ctas, per_sm, want):
    """The cascade's prefix parts (non-causal, 128-row tiles of equal work) split into at most
    ``ctas_per_sm`` programs per SM, rounded down: 2 tiles x 8 KV heads on 132 SMs take 16 splits (256
    programs), not 17 (272: 8 programs in a tail wave, the H200's 42.4 us ncu row of 2026-12-03); the
    ``noncausal`` entry's ``ctas_per_sm`` wins over the decode bucket's (``per_sm``: the one in force;
    2 from ``d128/g4/decode_split``, 1 from ``d128/g4/decode_tiny``; none: a full batch, unsplit)."""
    prov = PagedAttention(AttentionConfig(32, 8, 128, 16, BF16), "triton", DEVICE).provider
    prov._sms = H200_SMS
    key = tiles.key(128, 4, "noncausal")
    entry = {k: v for k, v in tiles.TILES[key].items() if k != "ctas_per_sm"}
    entry.update({"ctas_per_sm": ctas} if ctas else {})
    with table({key: entry}):
        got = prov.split_count(tiles_, 8192, noncausal=True)
        assert got == want
        if per_sm:
            assert tiles_ * 8 * got <= per_sm * H200_SMS < tiles_ * 8 * (got + 1)
    assert prov.split_count(2, 8192) == 16  # decode-shaped plans: the decode_split entry's whole waves


def test_full_batch_split_matches_the_reference():
    """The ``decode`` bucket's split path (a full batch, fused merge) against the reference, on a GPU of 16 SMs
    (the H200's 132 take a batch 8x larger for the same path: minutes in the interpreter)."""
    c = random_case(
        ForwardMode.DECODE,
        [1] * 5,
        [1100 + 37 * i for i in range(5)],
        cfg(16, 4, page=16, dtype=BF16),
        DEVICE,
        seed=5,
    )
    e = {"kernel": "decode", "block_n": 32, "num_warps": 4, "num_stages": 3, "fused_merge": True, "ctas_per_sm": 4}
    plan = run_case(c, {tiles.key(c.config.head_dim, c.config.group_size, "decode"): e}, sms=16)
    launch = triton_launch(plan)
    assert launch["num_splits"] == 4 and launch["kernel"] == "decode"  # 5 x 4 heads = 20 >= 16; 4*16/20 -> 4


# ---- the table ----------------------------------------------------------------------------------
def test_seed_table_keeps_the_2026_11_29_choices():
    """With the seeds, the provider picks what it picked before the table: the general kernel, the
    swept block sizes, 64 splits of small tiles at 1x32768, 3 splits at 16x16384."""
    llama = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    swept = [k for k in tiles.TILES if "/g*/" not in k]  # entries a sweep chose for exact groups

    def plan(mode, q, kv):
        saved = {k: tiles.TILES.pop(k) for k in swept}  # the seeds alone
        try:
            return planned_kernel(llama, lengths_batch(mode, q, kv), {})
        finally:
            tiles.TILES.update(saved)

    p = plan(ForwardMode.EXTEND, [300, 200], [300, 250])
    assert (p["kernel"], p["block_m"], p["block_n"]) == ("paged", 128, 32)
    p = plan(ForwardMode.DECODE, [1], [32768])
    assert (p["kernel"], p["num_splits"], p["block_n"]) == ("paged", 64, 64)
    p = plan(ForwardMode.DECODE, [1] * 4, [32768] * 4)  # 32 programs: 9 splits, below the small-tile rule
    assert (p["kernel"], p["num_splits"], p["block_n"]) == ("paged", 9, 128)
    p = plan(ForwardMode.DECODE, [1] * 16, [16384] * 16)
    assert (p["kernel"], p["num_splits"], p["block_n"]) == ("paged", 3, 128)
    p = plan(ForwardMode.DECODE, [1] * 64, [4096] * 64)
    assert (p["kernel"], p["num_splits"], p["block_n"]) == ("paged", 1, 128)
    p = plan(ForwardMode.TARGET_VERIFY, [64] * 2, [4160] * 2)
    assert (p["kernel"], p["block_m"], p["block_n"]) == ("paged", 128, 32)  # no mask here: the prefill tiles


def test_table_keys_and_lookup():
    T = tiles.TileEntry
    assert tiles.key(128, 4, "prefill") == "d128/g4/prefill" and tiles.key(96, 3, "decode") == "d128/g4/decode"
    assert tiles.key(256, "*", "verify") == "d256/g*/verify" and tiles.key(40, 1, "short") == "d64/g1/short"
    t = {"d128/g*/prefill": {"block_n": 32}, "d128/g4/prefill": {"block_n": 64}}
    assert tiles.lookup(128, 4, "prefill", t) == T(block_n=64) and tiles.lookup(128, 8, "prefill", t) == T(block_n=32)
    assert tiles.lookup(64, 4, "prefill", t) == tiles.NO_ENTRY
    t8 = {**t, "d128/g*/prefill/fp8": {"block_n": 16}}
    assert tiles.key(128, 4, "decode", fp8=True) == "d128/g4/decode/fp8"
    assert tiles.lookup(128, 4, "prefill", t8, fp8=True) == T(block_n=16)  # fp8's own entry, any group
    assert tiles.lookup(128, 4, "prefill", t8) == T(block_n=64)  # 16-bit caches never read /fp8
    assert tiles.lookup(128, 8, "verify", t8, fp8=True) == tiles.lookup(128, 8, "verify", t8)  # fallback
    wide = {"d128/g4/decode": {"block_n": 64}, "d128/g*/decode/fp8": {"block_n": 32}}
    assert tiles.lookup(128, 4, "decode_wide", wide) == T(block_n=64)  # falls back to decode
    assert tiles.lookup(128, 4, "decode_wide", wide, fp8=True) == T(block_n=32)  # decode/fp8 before 16-bit
    wide["d128/g4/decode_wide"] = {"block_n": 16}
    assert tiles.lookup(128, 4, "decode_wide", wide) == T(block_n=16)
    assert tiles.lookup(128, 4, "decode_wide", wide, fp8=True) == T(block_n=32)  # fp8 entries first
    assert tiles.lookup(128, 4, "decode", wide) == T(block_n=64)  # decode never reads decode_wide
    for k, e in tiles.TILES.items():  # every entry names a known bucket and kernel
        assert k.split("/")[2] in tiles.BUCKETS and e.get("kernel", "paged") in ("paged", "prefill", "decode"), k


@pytest.mark.parametrize("batch,bucket", [(66, "decode"), (64, "decode"), (67, "decode_wide"), (128, "decode_wide")])
def test_full_decode_batches_beyond_four_programs_an_sm_read_decode_wide(batch, bucket):
    """An unsplit decode batch of more than 4 * SMs programs (``B * Hkv``, 8 KV heads, 132 SMs: more
    than 528) plans with the ``decode_wide`` entry, one of at most that many with ``decode``'s."""
    config = cfg(32, 8, d=128)
    entries = {
        tiles.key(128, 4, "decode"): {"kernel": "decode", "block_n": 64, "num_warps": 2, "num_stages": 3},
        tiles.key(128, 4, "decode_wide"): {"kernel": "decode", "block_n": 16, "num_warps": 1, "num_stages": 3},
    }
    launch = planned_kernel(config, lengths_batch(ForwardMode.DECODE, [1] * batch, [2048] * batch), entries)
    assert launch["num_splits"] == 1 and launch["kernel"] == "decode"
    assert launch["block_n"] == (16 if bucket == "decode_wide" else 64)
