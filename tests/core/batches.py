"""Random paged batches for kernel tests: ragged lengths, permuted page tables, random tree masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnplug.bench.workloads import random_tree_mask
from attnplug.core import AttentionConfig, BatchMetadata, ForwardMode


@dataclass
class PagedCase:
    config: AttentionConfig
    batch: BatchMetadata
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_pages: int
    q_lens: list[int] | None = None  # as constructed (not derived from the page table)
    kv_lens: list[int] | None = None


def fresh_provider_instances(monkeypatch) -> None:
    """The shared provider instances (:func:`attnplug.core.providers.provider_instance`) start empty for the
    test, so none built under another test's environment or patches is reused."""
    from attnplug.core import providers

    monkeypatch.setattr(providers, "_INSTANCES", type(providers._INSTANCES)())


def random_case(
    mode: ForwardMode,
    q_lens: list[int],
    prefix_lens: list[int],
    config: AttentionConfig,
    device: str | torch.device = "cpu",
    seed: int = 0,
    extra_pages: int = 7,
    mask_kind: str = "tree",
) -> PagedCase:
    """A batch whose request ``b`` has ``prefix_lens[b]`` cached tokens then ``q_lens[b]`` new ones.

    Pages are a random permutation of ``[0, num_pages)`` (with spare pages that hold garbage, so a
    wrong page index shows up). For TARGET_VERIFY a custom mask is built: all prefix keys visible,
    a random tree over the draft tokens (``mask_kind="tree"``), a chain (``"chain"``) or random bits
    (``"random"``, every row keeps at least one key).
    """
    gen = torch.Generator().manual_seed(seed)
    P = config.page_size
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    n_pages = [-(-l // P) for l in kv_lens]
    num_pages = sum(n_pages) + extra_pages
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    kv_indices = perm[: sum(n_pages)].clone()
    kv_indptr = torch.tensor([0] + n_pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([(l - 1) % P + 1 if l else 0 for l in kv_lens], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    shape = config.kv_cache_shape(num_pages)
    dt = config.dtype
    k_cache = torch.randn(shape, generator=gen).to(dt)
    v_cache = torch.randn(shape, generator=gen).to(dt)
    q = torch.randn(sum(q_lens), config.num_qo_heads, config.head_dim, generator=gen).to(dt)
    mask = None
    if mode == ForwardMode.TARGET_VERIFY:
        blocks = []
        for ql, kl in zip(q_lens, kv_lens):
            m = torch.ones(ql, kl, dtype=torch.bool)
            if mask_kind == "tree":
                m[:, kl - ql :] = random_tree_mask(ql, gen)
            elif mask_kind == "chain":  # a linear draft: causal over the draft tokens
                m[:, kl - ql :] = torch.ones(ql, ql, dtype=torch.bool).tril()
            else:
                m = torch.rand(ql, kl, generator=gen) < 0.5
                m[torch.arange(ql), torch.randint(0, max(kl, 1), (ql,), generator=gen)] = True
            blocks.append(m.flatten())
        mask = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    batch = BatchMetadata(mode, qo_indptr, kv_indptr, kv_indices, last, custom_mask=mask)
    dev = torch.device(device)
    return PagedCase(config, batch, q.to(dev), k_cache.to(dev), v_cache.to(dev), num_pages, list(q_lens), kv_lens)


def dense_reference(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of ``case`` from its construction (``q_lens`` / ``kv_lens`` lists, the page ids
    and mask it was built with), one token at a time: an oracle that shares no code with the core
    (not ``make_plan``, not ``reference.py``). Returns ``(out [T, Hq, D], lse [T, Hq])`` (natural log;
    a row that sees no key: 0 and ``-inf``)."""
    cfg, b_ = case.config, case.batch
    assert case.q_lens is not None and case.kv_lens is not None, "case built without its lengths"
    P, g = cfg.page_size, cfg.num_qo_heads // cfg.num_kv_heads
    ind, idx = b_.kv_indptr.tolist(), b_.kv_indices.tolist()
    k_all, v_all, q_all = (
        case.k_cache.detach().cpu().double(),
        case.v_cache.detach().cpu().double(),
        case.q.detach().cpu().double(),
    )
    outs, lses, t0, m0 = [], [], 0, 0
    for b, (ql, kl) in enumerate(zip(case.q_lens, case.kv_lens)):
        pages = idx[ind[b] : ind[b + 1]]
        assert len(pages) == -(-kl // P), f"request {b}: {len(pages)} pages for {kl} tokens of page size {P}"
        tok = [(pages[t // P], t % P) for t in range(kl)]
        if cfg.kv_layout == "NHD":
            k = torch.stack([k_all[p, o] for p, o in tok]) if kl else k_all.new_zeros(0, cfg.num_kv_heads, cfg.head_dim)
            v = torch.stack([v_all[p, o] for p, o in tok]) if kl else k.clone()
        else:
            k = (
                torch.stack([k_all[p, :, o] for p, o in tok])
                if kl
                else k_all.new_zeros(0, cfg.num_kv_heads, cfg.head_dim)
            )
            v = torch.stack([v_all[p, :, o] for p, o in tok]) if kl else k.clone()
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        q = q_all[t0 : t0 + ql]
        s = torch.einsum("qhd,khd->hqk", q, k) * cfg.scale
        if cfg.logits_soft_cap > 0:
            s = cfg.logits_soft_cap * torch.tanh(s / cfg.logits_soft_cap)
        pos = torch.arange(kl - ql, kl)[:, None]
        key = torch.arange(kl)[None, :]
        if b_.custom_mask is not None:
            vis = b_.custom_mask[m0 : m0 + ql * kl].cpu().bool().view(ql, kl)
            m0 += ql * kl
        else:
            vis = (key <= pos) if b_.causal else torch.ones(ql, kl, dtype=torch.bool)
        if cfg.window_left >= 0:
            vis = vis & (key >= pos - cfg.window_left)
        s = s.masked_fill(~vis[None], float("-inf"))
        lse = torch.logsumexp(s, -1)  # [H, q]
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        lses.append(lse.transpose(0, 1))
        t0 += ql
    return torch.cat(outs), torch.cat(lses)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against reference ``b`` (NaN in ``a`` gives NaN)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---- errors per request and per head -----------------------------------------------------------------
# Per (request, head) block of rows: max abs error and relative error = max abs error / max |ref| of the
# block (floored), so one wrong row among hundreds cannot hide in a whole-output norm.
TOLERANCES = {
    torch.float32: dict(rel=1e-5, abs=1e-5),
    torch.bfloat16: dict(rel=2e-2, abs=4e-2),  # CPU calibration: worst rel 1.0e-2, abs 2.1e-2 (|out| up to ~4)
    torch.float16: dict(rel=4e-3, abs=4e-3),
}


def block_errors(out: torch.Tensor, ref: torch.Tensor, qo_indptr) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max_abs [B, H], rel [B, H])`` of ``out`` against ``ref`` (``[T, H, D]``) per request and head.

    A request without query rows gets 0. NaN/inf anywhere in ``out`` gives NaN (never a pass)."""
    qo = [int(x) for x in torch.as_tensor(qo_indptr).cpu().tolist()]
    o, r = out.detach().float().cpu(), ref.detach().float().cpu()
    assert o.shape == r.shape, f"shape {tuple(o.shape)} != reference {tuple(r.shape)}"
    B, H = len(qo) - 1, o.shape[1]
    mx, rel = torch.zeros(B, H), torch.zeros(B, H)
    for b in range(B):
        if qo[b + 1] == qo[b]:
            continue
        ob, rb = o[qo[b] : qo[b + 1]], r[qo[b] : qo[b + 1]]
        e = (ob - rb).abs().amax(dim=(0, 2))  # [H]
        bad = ~torch.isfinite(ob).all(dim=2).all(dim=0)
        e = torch.where(bad, torch.full_like(e, float("nan")), e)
        mx[b] = e
        rel[b] = e / rb.abs().amax(dim=(0, 2)).clamp_min(1e-6)
    return mx, rel


def assert_close_per_request_head(out, ref, qo_indptr, dtype: torch.dtype, what: str = "", tol: dict | None = None):
    """Every (request, head) within ``tol`` (default ``TOLERANCES[dtype]``) in max abs AND relative error.

    NaN never passes (``not (nan <= tol)``). The failure names the worst blocks."""
    tol = tol or TOLERANCES[dtype]
    assert torch.isfinite(ref.float()).all(), f"{what}: non-finite reference"
    mx, rel = block_errors(out, ref, qo_indptr)
    ok = (mx <= tol["abs"]) & (rel <= tol["rel"])  # NaN compares False
    if not bool(ok.all()):
        bad = (~ok).nonzero().tolist()
        worst = ", ".join(f"req {b} head {h}: max abs {mx[b, h]:.3g}, rel {rel[b, h]:.3g}" for b, h in bad[:6])
        raise AssertionError(f"{what}: {len(bad)} of {ok.numel()} (request, head) blocks over {tol}: {worst}")
    return mx, rel


def triton_launch(plan) -> dict:
    """The triton provider's launch choices of ``plan`` (the ONE place tests read provider state):
    ``num_splits``, ``block_n``, ``block_m``, ``block_q``, ``partial_lse`` (``[T, Hq, S]`` base-2 split
    LSEs, a workspace the run writes: poison it before the run, read it after), ``partial``, ``kernel``
    (``"paged"``, ``"prefill"``, ``"decode"`` or ``"gluon"``), ``fused_merge`` (the decode kernel's last split
    merges)."""
    a = plan.state  # TritonState
    return dict(
        num_splits=a.num_splits,
        block_n=a.block_n,
        block_m=a.block_m,
        block_q=a.block_q,
        partial_lse=a.partial_lse,
        partial=a.partial,
        num_tiles=a.num_tiles,
        kernel=a.kernel,
        fused_merge=a.counters is not None,
    )


# ---- multi-step draft: cases and an oracle that shares no code with core/draft.py ----------------------
def draft_case(seq_lens: list[int], page: int, topk: int, steps: int, seed: int):
    """Random prefix CSR over permuted pages + distinct draft token slots taken from spare pages.

    Returns ``(kv_indptr, kv_indices, kv_last_page_len, draft_slots [B, topk, steps], num_pages)``."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    npg = [-(-s // page) for s in seq_lens]
    n_draft = B * topk * steps
    spare = -(-n_draft // page) + 2
    num_pages = sum(npg) + spare
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    kv_indices = perm[: sum(npg)].clone()
    kv_indptr = torch.tensor([0] + npg, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([(s - 1) % page + 1 if s else 0 for s in seq_lens], dtype=torch.int32)
    spare_slots = (perm[sum(npg) :].long()[:, None] * page + torch.arange(page)).flatten()
    draft = spare_slots[torch.randperm(spare_slots.numel(), generator=g)[:n_draft]].view(B, topk, steps)
    return kv_indptr, kv_indices, last, draft.to(torch.int32), num_pages


def draft_rows(kv_indptr, kv_indices, seq_lens: list[int], draft, page: int, step: int) -> list[list[int]]:
    """Token slots each draft row ``b*topk + j`` attends to at ``step``, one python loop per token:
    the prefix of request ``b`` then its branch's draft tokens ``0..step``."""
    rows = []
    B, K, _ = draft.shape
    for b in range(B):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].tolist()
        prefix = [pages[t // page] * page + t % page for t in range(seq_lens[b])]
        for j in range(K):
            rows.append(prefix + draft[b, j, : step + 1].tolist())
    return rows


def dense_rows(q, k_cache, v_cache, rows: list[list[int]], config) -> torch.Tensor:
    """float64 softmax attention of row ``r`` of ``q [R, Hq, D]`` over exactly the token slots
    ``rows[r]`` of an NHD paged cache (slot = page * P + offset). Returns ``[R, Hq, D]`` float64."""
    kf = k_cache.detach().cpu().double().reshape(-1, config.num_kv_heads, config.head_dim)
    vf = v_cache.detach().cpu().double().reshape(-1, config.num_kv_heads, config.head_dim)
    g = config.num_qo_heads // config.num_kv_heads
    qd = q.detach().cpu().double()
    out = torch.zeros(qd.shape, dtype=torch.float64)
    for r, slots in enumerate(rows):
        k = kf[torch.tensor(slots, dtype=torch.long)].repeat_interleave(g, 1)  # [n, Hq, D]
        v = vf[torch.tensor(slots, dtype=torch.long)].repeat_interleave(g, 1)
        s = torch.einsum("hd,nhd->hn", qd[r], k) * config.scale
        if config.logits_soft_cap > 0:
            s = config.logits_soft_cap * torch.tanh(s / config.logits_soft_cap)
        out[r] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def chain_batch(
    config: AttentionConfig, B: int, q: int, width: int, num_pages: int, g: torch.Generator, max_prefix: int = 150
):
    """A spec-decode verify batch as vLLM describes it: ``(seq_lens [B] int32, q tokens included;
    block_table [B, width] int32 of distinct pages 1..num_pages-1; the same batch as BatchMetadata
    with the causal-chain mask)``."""
    from attnplug.core.cuda_graph import chain_mask  # noqa: PLC0415

    P = config.page_size
    seq = (torch.randint(0, max_prefix, (B,), generator=g) + q).to(torch.int32)
    table = (torch.randperm(num_pages - 1, generator=g)[: B * width] + 1).to(torch.int32).view(B, width)
    npg = [-(-int(s) // P) for s in seq]
    pages = torch.cat([table[b, : npg[b]] for b in range(B)])
    ind = torch.tensor([0] + npg).cumsum(0).to(torch.int32)
    last = torch.tensor([(int(s) - 1) % P + 1 for s in seq], dtype=torch.int32)
    mask = torch.cat([chain_mask(q, int(s)).flatten() for s in seq])
    qo = (torch.arange(B + 1) * q).to(torch.int32)
    return seq, table, BatchMetadata(ForwardMode.TARGET_VERIFY, qo, ind, pages, last, custom_mask=mask)


def interpreter_smoke_skip():
    """``pytest.mark.skipif`` for a probe's ``--smoke`` run (CPU, Triton interpreter) where the installed
    triton's interpreter is too old for the kernels (< 3.7: the GPU machine's 3.6 compiles them instead)."""
    import pytest  # noqa: PLC0415
    import triton  # noqa: PLC0415

    old = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)
    return pytest.mark.skipif(
        old,
        reason=f"--smoke runs the Triton interpreter, which triton "
        f"{triton.__version__} cannot (>= 3.7); the probe runs compiled here",
    )


def brute_groups(batch, page: int, q: int = 1, min_saved: int = 1) -> list[tuple[int, int, int, int]]:
    """A graph replay's cascade groups, by brute force: maximal runs ``[start, end)`` of consecutive
    requests whose first page ids are equal (each with a shareable page, ``(kv_len - q) // page``),
    with the leading page ids all members share (``found``, 0 for one request) and the pages cut
    (``found`` where ``(members - 1) * found >= min_saved``, else 0): ``[(start, end, found, cut)]``."""
    ind, idx, last = batch.kv_indptr.tolist(), batch.kv_indices.tolist(), batch.kv_last_page_len.tolist()
    rows = [idx[ind[b] : ind[b + 1]] for b in range(len(ind) - 1)]
    sh = [max((len(r) - 1) * page + last[b] - q, 0) // page if r else 0 for b, r in enumerate(rows)]
    out, b = [], 0
    while b < len(rows):
        e = b + 1
        while e < len(rows) and sh[e] and sh[e - 1] and rows[e][0] == rows[e - 1][0]:
            e += 1
        found = 0
        if e - b >= 2:
            while found < min(sh[b:e]) and all(rows[x][found] == rows[b][found] for x in range(b, e)):
                found += 1
        out.append((b, e, found, found if (e - b - 1) * found >= min_saved and found else 0))
        b = e
    return out
