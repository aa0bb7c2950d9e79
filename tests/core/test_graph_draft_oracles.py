"""Graph-state replays and every multi-step draft step of the triton provider (CPU, Triton interpreter)
against independent oracles, not against the same provider's eager run.

* ``GraphState`` (the CUDA-graph static buffers; on CPU nothing is captured, the same plans and
  buffers run eagerly) refreshed by each replay path: ``update`` (host CSR, tree masks),
  ``update_from_block_table`` (vLLM's block table; verify = causal chain) and the token-table form
  (SGLang's ``req_to_token`` with ``req_pool_indices``), padded batches ``B < bs``: the real rows are
  compared per (request, head) with the float32 reference of the unpadded batch AND a float64 dense
  oracle built from the case's own lists; padded rows must be written (NaN-poisoned before).
* every draft step, through ``MultiStepDraftPlanner`` and through one token-granular ``GraphState``
  per step (as the engines replay them), against dense attention over the token slots each row must
  see, listed by a python loop (``batches.draft_rows``): no code shared with ``core/draft.py``.

The GPU twin is ``tests/gpu/test_graphs_gpu.py`` (captured graphs, every provider).
"""

from __future__ import annotations

import math

import pytest
import torch
from batches import (
    assert_close_per_request_head,
    dense_reference,
    dense_rows,
    draft_case,
    draft_rows,
    random_case,
)

from attnplug.core import AttentionConfig, ForwardMode
from attnplug.core.cuda_graph import GraphState
from attnplug.core.draft import MultiStepDraftPlanner, token_config, token_view
from attnplug.core.plan import make_plan
from attnplug.core.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_BS, N_DRAFT, PAD_PAGE = 4, 3, 0


def cfg(page, dtype=torch.bfloat16):
    return AttentionConfig(8, 2, 32, page, dtype)


def check_rows(out, case, what):
    """Real rows of a replay vs the float32 reference of the unpadded batch and the dense oracle."""
    T = case.q.shape[0]
    plan = make_plan(case.config, case.batch, case.num_pages, device=DEVICE)
    ref, _ = reference_attention(plan, case.q, case.k_cache, case.v_cache)
    dense, _ = dense_reference(case)
    qo = case.batch.qo_indptr
    assert_close_per_request_head(ref, dense, qo, torch.float32, f"{what}: reference vs dense")
    assert_close_per_request_head(out[:T], ref, qo, case.config.dtype, f"{what}: replay vs reference")
    assert torch.isfinite(out[T:].float()).all(), f"{what}: a padded row was not written (NaN) or is not finite"


def replay(gs, bs, case, q_per):
    T = case.q.shape[0]
    qpad = torch.cat([case.q, torch.randn(bs * q_per - T, *case.q.shape[1:]).to(case.q)])
    out = torch.full_like(qpad, math.nan)
    gs.run(bs, qpad, case.k_cache, case.v_cache, out)
    return out


def prefixes(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150, (B,), generator=g).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_graph_replay_update_matches_reference(mode, page, dtype):
    """``update`` from host CSR (verify: random tree masks), every bs, real batches B <= bs."""
    q_per = 1 if mode == "decode" else N_DRAFT
    gs = GraphState(
        cfg(page, dtype),
        "triton",
        MAX_BS,
        MAX_BS * q_per,
        MAX_BS * 160 // page + MAX_BS,
        DEVICE,
        mode,
        num_draft_tokens=N_DRAFT,
        pad_page=PAD_PAGE,
        num_kv_splits=2,
    )
    for bs in range(1, MAX_BS + 1):
        gs.prepare_capture(bs)
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.TARGET_VERIFY
    for bs, B in ((1, 1), (3, 2), (4, 4), (4, 1)):
        seed = 10 * bs + B
        c = random_case(fm, [q_per] * B, prefixes(B, seed), cfg(page, dtype), DEVICE, seed=seed)
        gs.update(c.batch, bs)
        check_rows(replay(gs, bs, c, q_per), c, f"{mode} update bs={bs} B={B}")


def _block_table(case, width, fill=-1):
    """``[B, width]`` page table of ``case`` from its own page lists (entries past a request's pages: ``fill``)."""
    ind, idx = case.batch.kv_indptr.tolist(), case.batch.kv_indices.tolist()
    bt = torch.full((len(ind) - 1, width), fill, dtype=torch.int32)
    for b in range(len(ind) - 1):
        pages = idx[ind[b] : ind[b + 1]]
        bt[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return bt


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_graph_replay_from_block_table_matches_reference(mode, page):
    """vLLM's path: ``update_from_block_table`` (one launch) from a device block table; verify writes
    the causal-chain mask, so the oracle is a causal extend of ``N_DRAFT`` tokens per request."""
    q_per = 1 if mode == "decode" else N_DRAFT
    gs = GraphState(
        cfg(page),
        "triton",
        MAX_BS,
        MAX_BS * q_per,
        MAX_BS * 160 // page + MAX_BS,
        DEVICE,
        mode,
        num_draft_tokens=N_DRAFT,
        pad_page=PAD_PAGE,
        max_seq_len=160,
        num_kv_splits=2,
    )
    for bs in range(1, MAX_BS + 1):
        gs.prepare_capture(bs)
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    width = -(-160 // page) + 3
    for bs, B in ((1, 1), (3, 2), (4, 4), (4, 3)):
        seed = 7 * bs + B
        c = random_case(fm, [q_per] * B, prefixes(B, seed), cfg(page), DEVICE, seed=seed)
        seq = torch.tensor(c.kv_lens, dtype=torch.int32)
        gs.update_from_block_table(seq.to(DEVICE), _block_table(c, width).to(DEVICE), bs)
        check_rows(replay(gs, bs, c, q_per), c, f"{mode} block table bs={bs} B={B}")
        # what FlashInfer's plan would read (the triton launch reads kv_lens): the CSR of the real rows
        assert gs.kv_last_page_len[:B].tolist() == [(n - 1) % page + 1 for n in c.kv_lens], "kv_last_page_len"
        assert gs.kv_lens[:B].tolist() == c.kv_lens, "kv_lens"


@pytest.mark.parametrize("page", [1, 16])
def test_graph_replay_from_token_table_matches_reference(page):
    """SGLang's path: token-slot table rows picked by ``req_pool_indices`` (``row_ids``), ``entry_tokens = P``."""
    gs = GraphState(
        cfg(page),
        "triton",
        MAX_BS,
        MAX_BS,
        MAX_BS * 160 // page + MAX_BS,
        DEVICE,
        "decode",
        pad_page=PAD_PAGE,
        max_seq_len=160,
    )
    gs.prepare_capture(MAX_BS)
    for B, seed in ((3, 1), (4, 2)):
        c = random_case(ForwardMode.DECODE, [1] * B, prefixes(B, seed), cfg(page), DEVICE, seed=seed)
        bt = _block_table(c, -(-160 // page), fill=0)
        rows = torch.randperm(8, generator=torch.Generator().manual_seed(seed))[:B]  # request b lives in rows[b]
        table = torch.full((8, bt.shape[1] * page), -1, dtype=torch.int32)
        t = torch.arange(bt.shape[1] * page)
        for b in range(B):
            table[rows[b]] = bt[b][t // page] * page + t % page
        seq = torch.tensor(c.kv_lens, dtype=torch.int64)
        gs.update_from_block_table(seq.to(DEVICE), table.to(DEVICE), MAX_BS, row_ids=rows.to(DEVICE), entry_tokens=page)
        check_rows(replay(gs, MAX_BS, c, 1), c, f"token table B={B}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page,topk,steps,splits", [(16, 2, 3, 1), (1, 3, 2, 2), (16, 1, 2, 3)])
def test_every_draft_step_matches_dense(page, topk, steps, splits, dtype):
    """Each draft step, eager (``MultiStepDraftPlanner.run``) and through a per-step ``GraphState``
    fed with ``step_batches`` (padded to more rows), vs dense attention over the listed slots."""
    seq_lens = [37, 0, 70]
    B = len(seq_lens)
    ind, idx, last, draft, num_pages = draft_case(seq_lens, page, topk, steps, seed=page + topk + steps)
    c = cfg(page, dtype)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(dtype).to(DEVICE)
    v = torch.randn(c.kv_cache_shape(num_pages), generator=g).to(dtype).to(DEVICE)
    planner = MultiStepDraftPlanner(c, topk, steps, max_batch=B, provider="triton", device=DEVICE, num_kv_splits=splits)
    planner.plan(ind, idx, last, draft, num_pages=num_pages)
    batches = planner.step_batches(ind, idx, last, draft)
    R, bs_rows = B * topk, B * topk + 2  # the graph batch has 2 padded rows
    tc = token_config(c)
    kt, vt = token_view(k, c), token_view(v, c)
    qo = torch.arange(R + 1)
    for i in range(steps):
        q = torch.randn(R, c.num_qo_heads, c.head_dim, generator=g).to(dtype).to(DEVICE)
        want = dense_rows(q, k, v, draft_rows(ind, idx, seq_lens, draft, page, i), c)
        eager = planner.run(i, q, k, v, torch.full_like(q, math.nan))
        assert_close_per_request_head(eager, want, qo, dtype, f"draft step {i} (planner) vs dense")
        gs = GraphState(
            tc,
            "triton",
            bs_rows,
            bs_rows,
            bs_rows * (max(seq_lens) + steps),
            DEVICE,
            pad_page=0,
            max_seq_len=max(seq_lens) + steps,
            num_kv_splits=splits,
        )
        gs.prepare_capture(bs_rows)
        gs.update(batches[i], bs_rows)
        qpad = torch.cat([q, torch.randn(bs_rows - R, *q.shape[1:], generator=g).to(q)])
        out = torch.full_like(qpad, math.nan)
        gs.run(bs_rows, qpad, kt, vt, out)
        assert_close_per_request_head(out[:R], want, qo, dtype, f"draft step {i} (graph state) vs dense")
        assert torch.isfinite(out[R:].float()).all(), "padded draft rows not written"
