"""GraphState.update_from_block_table (one Triton launch, attnplug.core.kernels.graph_update) against a
brute-force construction of the padded batch, and against GraphState.update on the same batch:
random batch sizes, random page tables (strided, int32 / int64), engine padding rows (seq_len <= 0),
rows past n, page sizes 1 / 16, decode and causal-chain verify, FA3's block table."""

from __future__ import annotations

import math

import pytest
import torch
from batches import rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode, UnsupportedFeature
from attnplug.core.cuda_graph import GraphState
from attnplug.core.kernels.graph_update import graph_batch_from_block_table
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # conftest: interpreter without CUDA
MAX_BS, MAX_SEQ, PAD_PAGE, SENTINEL, Q_VERIFY = 6, 70, 2, -77, 3


def cfg(page):
    return AttentionConfig(4, 2, 32, page, torch.float32)


def expected(seq, table, bs, P, pad_kv, q, trees=None):
    """Brute force: per request its KV length and pages; then CSR, lengths and chain mask (``trees``:
    request ``b``'s ``[q, q]`` tree part after a visible prefix instead)."""
    lens, pages = [], []
    for b in range(bs):
        s = int(seq[b]) if b < len(seq) else 0
        if s > 0:
            lens.append(s)
            pages.append([int(x) for x in table[b, : -(-s // P)]])
        else:
            lens.append(pad_kv)
            pages.append([PAD_PAGE] * -(-pad_kv // P))
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + len(p))
    last = [s - (len(p) - 1) * P for s, p in zip(lens, pages)]
    mask = []
    for s, (b, _) in zip(lens, enumerate(pages)):
        padded = b >= len(seq) or int(seq[b]) <= 0
        if trees is not None and not padded:
            mask += [1 if c < s - q else int(trees[b][i][c - (s - q)]) for i in range(q) for c in range(s)]
            continue
        mask += [1 if padded or c <= s - q + i else 0 for i in range(q) for c in range(s)]
    return dict(
        kv_indptr=indptr,
        kv_indices=sum(pages, []),
        kv_last_page_len=last,
        kv_lens=lens,
        mask=mask,
        mask_indptr=[0] + [q * x for x in torch.tensor(lens).cumsum(0).tolist()],
        mask_free=[s - q for s in lens],
        pages=pages,
    )


def random_table(draw_seed, n, P, W, idx_dtype, strided):
    g = torch.Generator().manual_seed(draw_seed)
    table = torch.randperm(n * W + 10, generator=g)[: n * W].view(n, W).to(idx_dtype) + 10
    if strided:  # a column-sliced view of a wider table (vLLM's persistent buffer is wider than used)
        wide = torch.full((n, W + 5), -1, dtype=idx_dtype)
        wide[:, 2 : W + 2] = table
        table = wide[:, 2 : W + 2]
    return table


@pytest.mark.parametrize("mode", ["decode", "verify", "tree"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([1, 16]),
    bs=st.integers(1, MAX_BS),
    data=st.data(),
    idx_dtype=st.sampled_from([torch.int32, torch.int64]),
    strided=st.booleans(),
)
def test_matches_brute_force_and_writes_nothing_else(mode, page, bs, data, idx_dtype, strided):
    """``tree``: a verify family given the engine's tree masks (SGLang's layout: the real requests'
    ``[q, kv_len]`` blocks back to back, random tree parts)."""
    q = 1 if mode == "decode" else Q_VERIFY
    n = data.draw(st.integers(0, bs), label="n")
    seq = data.draw(st.lists(st.integers(-1, MAX_SEQ), min_size=n, max_size=n), label="seq_lens")
    seq = [s if s <= 0 else max(s, q) for s in seq]
    W = -(-MAX_SEQ // page)
    table = random_table(sum(seq) + n, max(n, 1), page, W, idx_dtype, strided)[:n]
    gs = GraphState(
        cfg(page),
        "triton",
        MAX_BS,
        MAX_BS * q,
        MAX_BS * W,
        DEV,
        "decode" if mode == "decode" else "verify",
        num_draft_tokens=q,
        pad_page=PAD_PAGE,
        max_seq_len=MAX_SEQ,
    )
    gs.prepare_capture(bs)
    names = ["kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens"] + (
        ["mask", "mask_indptr", "mask_free"] if mode != "decode" else []
    )
    trees, src = None, None
    if mode == "tree":
        g = torch.Generator().manual_seed(sum(seq) + 7 * n)
        trees = [(torch.rand(q, q, generator=g) < 0.5) | torch.eye(q, dtype=torch.bool) for _ in seq]
        blocks = [torch.cat([torch.ones(q, x - q, dtype=torch.bool), t], 1) for x, t in zip(seq, trees) if x > 0]
        src = torch.cat([b.reshape(-1) for b in blocks] + [torch.zeros(5, dtype=torch.bool)]).to(DEV)
    for name in names:
        getattr(gs, name).fill_(SENTINEL)
    seq_t = torch.tensor(seq, dtype=idx_dtype).to(DEV)
    gs.update_from_block_table(seq_t, table.to(DEV), bs, custom_mask=src)
    want = expected(seq, table, bs, page, gs.pad_kv_len, q, trees)
    sizes = dict(
        kv_indptr=bs + 1,
        kv_last_page_len=bs,
        kv_lens=bs,
        mask_indptr=bs + 1,
        mask_free=bs,
        kv_indices=len(want["kv_indices"]),
        mask=len(want["mask"]),
    )
    for name in names:
        got = getattr(gs, name).cpu().long()
        k = sizes[name]
        assert got[:k].tolist() == want[name], name
        sentinel = SENTINEL if name != "mask" else SENTINEL & 0xFF
        assert (got[k:] == sentinel).all(), f"{name}: wrote past slot {k}"


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_same_buffers_as_update(mode):
    """On a batch without engine padding rows both update paths leave identical static buffers."""
    q, page, bs = (1 if mode == "decode" else Q_VERIFY), 4, 5
    seq = torch.tensor([9, 1 + q, 33, 17], dtype=torch.int32)
    table = random_table(3, 4, page, 20, torch.int32, False)
    a, b = (
        GraphState(
            cfg(page),
            "triton",
            MAX_BS,
            MAX_BS * q,
            200,
            DEV,
            mode,
            num_draft_tokens=q,
            pad_page=PAD_PAGE,
            max_seq_len=80,
        )
        for _ in range(2)
    )
    for gs in (a, b):
        gs.prepare_capture(bs)
    qo = torch.arange(5, dtype=torch.int32) * q
    mask = None
    if mode == "verify":
        mask = torch.cat(
            [torch.tensor([[c <= s - q + i for c in range(s)] for i in range(q)]).flatten() for s in seq.tolist()]
        )
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.TARGET_VERIFY
    a.update(BatchMetadata.from_block_table(fm, qo, table, seq, page, custom_mask=mask), bs)
    b.update_from_block_table(seq.to(DEV), table.to(DEV), bs)
    nnz = int(a.kv_indptr[bs])
    assert torch.equal(a.kv_indptr, b.kv_indptr) and torch.equal(a.kv_indices[:nnz], b.kv_indices[:nnz])
    assert torch.equal(a.kv_last_page_len, b.kv_last_page_len) and torch.equal(a.kv_lens, b.kv_lens)
    if mode == "verify":
        m = int(a.mask_indptr[bs])
        assert torch.equal(a.mask[:m], b.mask[:m])
        assert torch.equal(a.mask_indptr, b.mask_indptr) and torch.equal(a.mask_free, b.mask_free)


def test_replay_after_block_table_update_equals_reference():
    """Attention through the updated plan equals the float32 reference on the real rows; the padding
    row and the engine padding row (seq_len 0) read only the pad page."""
    page, bs, D = 16, 4, 32
    gs = GraphState(cfg(page), "triton", bs, bs, 40, DEV, "decode", pad_page=PAD_PAGE, max_seq_len=160)
    plan = gs.prepare_capture(bs)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(cfg(page).kv_cache_shape(40), generator=g).to(DEV)
    v = torch.randn(cfg(page).kv_cache_shape(40), generator=g).to(DEV)
    k[PAD_PAGE], v[PAD_PAGE] = 0.5, 0.25
    table = torch.tensor([[7, 3, 9, 11, 0], [20, 21, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.int32)
    seq = torch.tensor([70, 17, 0], dtype=torch.int32)  # row 2: engine padding; row 3: past n
    assert gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs) is plan
    q = torch.randn(bs, 4, D, generator=g).to(DEV)
    out = torch.full_like(q, math.nan)
    gs.run(bs, q, k, v, out)
    real = BatchMetadata.from_block_table(
        ForwardMode.DECODE, torch.arange(3, dtype=torch.int32), table[:2], seq[:2], page
    )
    ref, _ = reference_attention(make_plan(cfg(page), real, 40, device=DEV), q[:2], k, v)
    assert rel_err(out[:2], ref) < 1e-4
    assert torch.allclose(out[2:].float().cpu(), torch.full((2, 4, D), 0.25)), "padding rows read the pad page"


def test_fa3_block_table():
    """The kernel's block-table output (FA3's) holds each request's pages, nothing past them."""
    P, bs = 4, 3
    i32 = dict(dtype=torch.int32, device=DEV)
    seq = torch.tensor([9, 0], **i32)
    table = torch.tensor([[5, 6, 7, 0], [1, 1, 1, 1]], **i32)
    outs = [torch.full((16,), SENTINEL, **i32) for _ in range(4)]
    bt = torch.full((bs, 6), SENTINEL, **i32)
    graph_batch_from_block_table(seq, table, bs, P, PAD_PAGE, 1, *outs, block_table_out=bt)
    assert bt.cpu().tolist() == [[5, 6, 7] + [SENTINEL] * 3, [PAD_PAGE] + [SENTINEL] * 5, [PAD_PAGE] + [SENTINEL] * 5]
    assert outs[0][:4].cpu().tolist() == [0, 3, 4, 5] and outs[1][:5].cpu().tolist() == [5, 6, 7, PAD_PAGE, PAD_PAGE]
    with pytest.raises(ValueError, match="seq_lens has 2 rows"):
        graph_batch_from_block_table(seq, table, 1, P, PAD_PAGE, 1, *outs)


class _RecordingWrapper:
    """Stands in for a FlashInfer CUDA-graph wrapper: records every ``plan`` call."""

    def __init__(self, *args, **kwargs):
        self.calls = []

    def plan(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def flashinfer_on_cpu(config):
    """The real FlashInfer provider (and so its real ``FlashInferGraph``) over recording wrappers."""
    import types

    from attnplug.core.providers.flashinfer import FlashInferProvider

    prov = object.__new__(FlashInferProvider)  # skip check_available (needs CUDA and flashinfer)
    prov.config, prov.device = config, torch.device(DEV)
    prov._fi = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_RecordingWrapper, BatchPrefillWithPagedKVCacheWrapper=_RecordingWrapper
    )
    prov._workspace, prov._wrappers = torch.zeros(8, dtype=torch.uint8), {}
    return prov


def test_flashinfer_plans_from_host_lengths_and_the_device_indices():
    """FlashInfer's replay: host kv_indptr / last-page lengths from ``host_seq_lens`` (no device read),
    kv_indices = the static buffer the launch wrote (FlashInfer copies it device to device)."""
    page, bs = 4, 4
    fi = flashinfer_on_cpu(cfg(page))
    gs = GraphState(cfg(page), fi, bs, bs, 64, DEV, "decode", pad_page=PAD_PAGE, max_seq_len=40)
    assert gs.needs_host_lengths
    gs.prepare_capture(bs)
    wrapper = gs.plans[bs].state.wrapper
    assert len(wrapper.calls) == 1  # the capture-time update planned it once, from the host twins
    seq = torch.tensor([9, 0, 13], dtype=torch.int64)
    table = random_table(1, 3, page, 10, torch.int32, False)
    with pytest.raises(UnsupportedFeature, match="attnplug: provider 'flashinfer'.*host sequence lengths"):
        gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs)
    gs.update_from_block_table(seq.to(DEV), table.to(DEV), bs, host_seq_lens=seq)
    (indptr, indices, last, *heads), kwargs = wrapper.calls[-1]
    want = expected(seq.tolist(), table, bs, page, gs.pad_kv_len, 1)
    assert heads == [4, 2, 32, page] and kwargs["sm_scale"] == cfg(page).scale
    assert indptr.device.type == "cpu" and indptr.tolist() == want["kv_indptr"]
    assert last.device.type == "cpu" and last.tolist() == want["kv_last_page_len"]
    assert indices.data_ptr() == gs.kv_indices.data_ptr() and indices.cpu().tolist() == want["kv_indices"]
    assert gs.kv_indptr[: bs + 1].cpu().tolist() == want["kv_indptr"]  # the launch read the host lengths
    vgs = GraphState(cfg(page), fi, bs, bs * 2, 64, DEV, "verify", num_draft_tokens=2, max_seq_len=40)
    vgs.prepare_capture(bs)
    with pytest.raises(UnsupportedFeature, match="use GraphState.update"):
        vgs.update_from_block_table(seq.to(DEV), table.to(DEV), bs, host_seq_lens=seq)


@pytest.mark.parametrize("page", [1, 4])
def test_token_table_with_row_ids(page):
    """SGLang's dialect: token-slot rows of ``req_to_token`` picked by ``req_pool_indices``."""
    bs, slots, ctx = 5, 7, 48
    g = torch.Generator().manual_seed(page)
    pages = torch.randperm(slots * ctx // page + 20, generator=g)[: slots * ctx // page].view(slots, ctx // page) + 20
    tokens = (pages.repeat_interleave(page, 1) * page + torch.arange(ctx) % page).to(torch.int32)  # [slots, ctx]
    row_ids = torch.tensor([5, 0, 3], dtype=torch.int64)
    seq = torch.tensor([1, 48, 13], dtype=torch.int64)
    gs = GraphState(cfg(page), "triton", bs, bs, bs * ctx, DEV, "decode", pad_page=PAD_PAGE, max_seq_len=ctx)
    gs.prepare_capture(bs)
    gs.update_from_block_table(seq.to(DEV), tokens.to(DEV), bs, row_ids=row_ids.to(DEV), entry_tokens=page)
    want = expected(seq.tolist(), pages[row_ids], bs, page, gs.pad_kv_len, 1)
    nnz = len(want["kv_indices"])
    assert gs.kv_indptr[: bs + 1].cpu().tolist() == want["kv_indptr"]
    assert gs.kv_indices[:nnz].cpu().tolist() == want["kv_indices"]
    assert gs.kv_last_page_len[:bs].cpu().tolist() == want["kv_last_page_len"]
    assert gs.kv_lens[:bs].cpu().tolist() == want["kv_lens"]
