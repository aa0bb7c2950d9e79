"""Shared-prefix (cascade) attention: read a prefix that several requests share once per group.

Requests of one batch often share a prefix (a system prompt, few-shot examples, ``n > 1``
sampling, search branches) that the engine's prefix cache maps to the *same physical pages*.
Plain paged attention still reads those pages once per request. Cascade splits each forward in two:

* **prefix part** - one virtual request per *group* of requests sharing ``pages`` leading page ids:
  all the group's query rows packed together, non-causal, over the shared pages only (every query
  of the group sits after the shared prefix, so it sees all of it);
* **suffix part** - every request over its remaining keys (the unshared pages and this forward's
  tokens) with its own mask: causal bottom-right, or the custom (tree) mask's remaining columns;

then an exact merge of the two softmax states by their log-sum-exp
(:func:`attnplug.core.kernels.merge.merge_state`, with a row map when the group's rows are not
contiguous). Each part is an ordinary :class:`~attnplug.core.plan.Plan` run by the same provider,
so every provider gets cascade through its own ``plan`` / ``run``.

Grouping happens on the host from the page table alone, once per forward (:func:`find_groups`):
a request may share its *shareable* pages - whole pages before its first query token, and before
any column its mask hides. A first-page check settles the common "nothing shared" case; one group
(every candidate starts on the same page) is found by a vectorized longest-common-prefix; several
or nested groups go through the core's radix tree (:func:`~attnplug.core.radix_tree.shared_prefix_groups`).
:func:`cascade_pays` is the cost model.

Environment: ``ATTNPLUG_CASCADE`` = ``0`` (off), ``1`` / unset (on where the cost model says it
pays), ``always`` (every shared group, e.g. for tests). ``ATTNPLUG_CASCADE_GRAPHS`` = ``1``: decode and
verify CUDA graphs read each group's prefix once too (:class:`CascadeGraph`: groups of consecutive requests;
providers whose ``graph_support.cascade`` is set), under the same mode; ``0`` / unset: graphs replay without
(opt-in: a replay whose batch shares nothing still runs the prefix launch, ``docs/cascade.md``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import graph_if
from .config import env_flag
from .graph_if import captured_if
from .graph_views import DeviceTable, HostBatch
from .metadata import BatchMetadata, ForwardMode
from .pages import indptr_from_counts, num_pages
from .plan import Plan
from .staging import to_device

if TYPE_CHECKING:
    from .kernels.graph_update import PrefixCut
    from .providers.base import GraphTiles

_nnz = np.count_nonzero

CASCADE_ENV = "ATTNPLUG_CASCADE"
CASCADE_GRAPHS_ENV = "ATTNPLUG_CASCADE_GRAPHS"
MODES = ("off", "auto", "always")
#: KV bytes a forward must save (per layer) before the extra prefix launch and merge pay (reading them
#: takes about as long as two kernel launches: ``docs/measured-choices.md``).
MIN_SAVED_BYTES = 32 << 20
#: Largest mean query rows per grouped request for which cascade pays: with more, every tile of
#: queries re-reads the prefix in both schemes, and the prefix part saves nothing.
MAX_ROWS_PER_REQUEST = 16


def cascade_mode(value: str | None = None) -> str:
    """``"off"`` / ``"auto"`` / ``"always"`` from ``value`` or ``$ATTNPLUG_CASCADE``."""
    v = (os.environ.get(CASCADE_ENV, "1") if value is None else value).strip().lower()
    mode = {"0": "off", "off": "off", "1": "auto", "auto": "auto", "on": "auto", "always": "always"}.get(v)
    if mode is None:
        raise ValueError(f"attnplug: {CASCADE_ENV} must be 0, 1 or always, got {v!r}")
    return mode


def graph_cascade_mode(graph_support, who: str | None = None) -> str:
    """The ``cascade`` argument of a decode / verify ``GraphState`` for a provider with ``graph_support``:
    :func:`cascade_mode` when ``$ATTNPLUG_CASCADE_GRAPHS`` is ``1`` (opt-in) and the provider's graphs
    can run it, else ``"off"``. Called at startup: where the mode is on, ``ATTNPLUG_GRAPH_IF=1`` on a torch
    without IF nodes raises (:func:`~attnplug.core.graph_if.check_requested`, naming ``who``)."""
    mode = cascade_mode() if env_flag(CASCADE_GRAPHS_ENV, False) and graph_support.cascade else "off"
    if mode != "off":
        graph_if.check_requested(who)
    else:
        graph_if.requested()  # a malformed value is refused either way
    return mode


@dataclass(frozen=True)
class Group:
    """Requests ``members`` (sorted batch indices) whose first ``pages`` page ids are the same."""

    pages: int
    members: np.ndarray


def shareable_pages(plan: Plan) -> np.ndarray:
    """``[B]`` int64: leading pages request ``b`` may share - whole pages before its first query token
    and before the first column its custom mask hides. All zero with a sliding window (the prefix's
    visibility then differs per query)."""
    if plan.config.window_left >= 0:
        return np.zeros(plan.batch_size, dtype=np.int64)
    P = plan.config.page_size
    committed = plan.kv_lens_cpu.numpy().astype(np.int64) - plan.q_lens_cpu.numpy()
    if plan.mask_free_cpu is not None:
        committed = np.minimum(committed, plan.mask_free_cpu.numpy())
    return np.maximum(committed, 0) // P


def first_pages_repeat(kv_indptr: np.ndarray, kv_indices: np.ndarray) -> np.ndarray | None:
    """The requests' first page ids, sorted, if two are equal (a shared prefix is possible); else
    ``None`` - the whole check when nothing is shared (a gather, a sort, a compare)."""
    if kv_indices.size == 0:
        return None
    first = kv_indices.take(kv_indptr[:-1], mode="clip")  # a request without pages reads the last id
    first.sort()  # sorted ids in [0, 2**31): their differences fit, and a zero one is a repeat
    return None if first.size < 2 or _nnz(first[1:] - first[:-1]) == first.size - 1 else first


def _same_as_first(kv_indices: np.ndarray, starts: np.ndarray, m: int) -> np.ndarray:
    """``[R - 1, m]`` bool: whether page ``j`` of row ``r + 1`` (the ``m`` page ids from ``starts[r + 1]``)
    equals page ``j`` of the first row (vectorized; a strided view when the rows are equally spaced).
    Every row inside ``kv_indices`` (``starts[r] + m <= kv_indices.size``)."""
    step = np.diff(starts)
    k = kv_indices.strides[0]
    if step.size and kv_indices.flags.c_contiguous and (step == step[0]).all() and step[0] > 0:
        # equal page counts: a strided view (the ndarray constructor checks the bounds as_strided leaves unchecked)
        rows = np.ndarray((starts.size, m), kv_indices.dtype, kv_indices, int(starts[0]) * k, (k * int(step[0]), k))
    else:
        rows = kv_indices[starts[:, None].astype(np.int64) + np.arange(m)]
    return rows[1:] == rows[0]


def _common_pages(same: np.ndarray) -> int:
    """Leading columns of :func:`_same_as_first`'s ``same`` that are True in every row: the pages every
    row shares with the first (the smallest longest-common-prefix)."""
    col = same.all(axis=0)
    return col.size if col.all() else int(col.argmin())


def _lcp_group(
    kv_indices: np.ndarray, starts: np.ndarray, shareable: np.ndarray, members: np.ndarray, min_pages: int
) -> Group | None:
    """One group of ``members`` (their first pages equal) with their common prefix, when their
    longest common prefixes with the first member are about one length (none longer than twice the
    shortest); ``None`` (nested prefixes: the radix tree decides) otherwise. Vectorized: a
    ``[members, pages]`` compare."""
    m = int(shareable.min())
    same = _same_as_first(kv_indices, starts, m)
    low = _common_pages(same)
    if low < min_pages:
        return None
    cut = 2 * low + 1  # a member sharing more than 2 * low pages with the first: nested
    if cut <= m and bool(same[:, low:cut].all(axis=1).any()):
        return None
    return Group(low, members)


def find_groups(
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    shareable: np.ndarray,
    min_pages: int = 1,
    first_repeats: bool = False,
) -> list[Group]:
    """Groups of requests sharing at least ``min_pages`` leading page ids (host, once per forward).

    Args:
        kv_indptr: ``[B+1]`` page CSR offsets; kv_indices: ``[nnz]`` page ids.
        shareable: ``[B]`` pages of each request that may be shared (:func:`shareable_pages`).
        first_repeats: the caller found two requests starting on one page (:func:`first_pages_repeat`
            is not ``None``), so the check is not repeated.

    Returns:
        Disjoint groups of >= 2 requests, each with its shared page count (``<=`` every member's
        ``shareable``); ``[]`` when nothing is shared. Every member's first ``pages`` page ids are
        checked equal (the prefix part reads the first member's).
    """
    if not first_repeats and first_pages_repeat(kv_indptr, kv_indices) is None:
        return []  # no two requests start on the same page: nothing is shared
    cand = np.flatnonzero(shareable >= min_pages)
    if cand.size < 2:
        return []
    starts = kv_indptr[cand]
    first = kv_indices[starts]
    order = np.argsort(first, kind="stable")
    bounds = np.flatnonzero(np.diff(first[order])) + 1  # requests starting on one page form a bucket
    groups, nested = [], []
    for bucket in np.split(order, bounds):
        if bucket.size < 2:
            continue
        g = _lcp_group(kv_indices, starts[bucket], shareable[cand[bucket]], cand[bucket], min_pages)
        (groups.append(g) if g is not None else nested.append(bucket))
    if nested:  # nested prefixes inside a bucket: the radix tree over its members' shareable page ids
        from .radix_tree import shared_prefix_groups  # noqa: PLC0415

        for bucket in nested:
            seqs = [
                kv_indices[s : s + n].tolist()
                for s, n in zip(starts[bucket].tolist(), shareable[cand[bucket]].tolist())
            ]
            groups += [Group(d, cand[bucket[np.asarray(idx)]]) for d, idx in shared_prefix_groups(seqs, 1, min_pages)]
    return groups


def cascade_pays(plan: Plan, groups: list[Group]) -> bool:
    """The cost model: the KV bytes the shared reads save must outweigh the prefix launch and the
    merge (:data:`MIN_SAVED_BYTES`), and the grouped requests must have few query rows each
    (:data:`MAX_ROWS_PER_REQUEST`; long extends re-read the prefix per query tile either way)."""
    if not groups:
        return False
    cfg = plan.config
    per_token = (1 if cfg.is_mla else 2) * cfg.num_kv_heads * cfg.head_dim  # MLA: one latent row, K and V
    page_bytes = per_token * cfg.page_size * cfg.dtype.itemsize
    saved = sum((g.members.size - 1) * g.pages for g in groups) * page_bytes
    q_lens = plan.q_lens_cpu.numpy()
    grouped = np.concatenate([g.members for g in groups])
    return saved >= MIN_SAVED_BYTES and float(q_lens[grouped].mean()) <= MAX_ROWS_PER_REQUEST


@dataclass
class CascadePlan:
    """One forward split into a suffix plan and a prefix plan, plus the merge's scratch.

    Attributes:
        groups: the shared-prefix groups.
        suffix: every request over its unshared keys (same requests, rows and mode as the forward).
        prefix: one virtual request per group: its members' query rows, non-causal, its shared pages.
        rows: ``[Tp]`` int64 on the device, the query row of each prefix-part row; ``None`` when the
            prefix part's rows are exactly ``0..T-1`` (one group of every request, in order).
        q_part, out_part: ``[Tp, Hq, D]`` scratch (``q_part`` only with ``rows``); lse_part ``[Tp, Hq]``
            and lse_suffix ``[T, Hq]`` float32.
    """

    groups: list[Group]
    suffix: Plan
    prefix: Plan
    rows: torch.Tensor | None
    q_part: torch.Tensor | None
    out_part: torch.Tensor
    lse_part: torch.Tensor
    lse_suffix: torch.Tensor

    @property
    def shared_tokens(self) -> int:
        """KV tokens the grouping reads once instead of once per member (summed over groups)."""
        P = self.suffix.config.page_size
        return sum((g.members.size - 1) * g.pages * P for g in self.groups)


def _packed(dev: torch.device, arrays: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """``arrays`` (1-D, int32 or int64, each keeping its dtype) as host tensors and their device twins
    (:func:`~attnplug.core.staging.to_device`: on a CPU device the host tensors themselves; else views
    of one asynchronous copy of them packed)."""
    host = {k: torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for k, a in arrays.items()}
    return host, dict(zip(host, to_device([h.numpy() for h in host.values()], dev)))


def build_cascade_plan(plan: Plan, groups: list[Group]) -> CascadePlan:
    """Split ``plan`` by ``groups`` (host index work; the metadata of both parts, the suffix's mask
    gather index and the prefix rows in one host->device copy)."""
    cfg, dev, P = plan.config, plan.device, plan.config.page_size
    B = plan.batch_size
    indptr, indices = plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy()
    qo = plan.qo_indptr_cpu.numpy()
    q_lens = plan.q_lens_cpu.numpy()
    shared = np.zeros(B, dtype=np.int64)
    for g in groups:
        shared[g.members] = g.pages

    # suffix: drop each request's shared pages; lengths, mask columns and mask-free bound shift with them
    counts = np.diff(indptr) - shared
    s_indptr = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(counts, out=s_indptr[1:])
    keep = [indices[a + s : b] for a, s, b in zip(indptr[:-1].tolist(), shared.tolist(), indptr[1:].tolist())]
    s_indices = np.concatenate(keep) if keep else indices[:0]
    kv_lens = plan.kv_lens_cpu.numpy().astype(np.int64) - shared * P
    s_last = np.where(counts > 0, plan.kv_last_page_len_cpu.numpy(), 0)  # a query-less request may lose every page
    masked = plan.mask is not None
    mask_arrays = {}
    if masked:
        mi = plan.mask_indptr_cpu.numpy()
        sizes = q_lens.astype(np.int64) * kv_lens
        mask_indptr_cpu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(sizes, out=mask_indptr_cpu[1:])
        old_kv = kv_lens + shared * P
        pieces = [
            mi[b] + np.arange(int(q_lens[b]))[:, None] * old_kv[b] + shared[b] * P + np.arange(int(kv_lens[b]))
            for b in range(B)
            if sizes[b]
        ]
        idx = np.concatenate([p.ravel() for p in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        mask_free_cpu = np.maximum(plan.mask_free_cpu.numpy() - shared * P, 0).astype(np.int32)
        mask_arrays = dict(m_idx=idx, m_indptr=mask_indptr_cpu, m_free=mask_free_cpu)
    # prefix: group g = its members' query rows over the first member's shared pages
    G = len(groups)
    members = np.concatenate([g.members for g in groups])
    m_len = q_lens[members].astype(np.int64)
    m_off = np.cumsum(m_len) - m_len  # first prefix-part row of each member
    rows = np.repeat(qo[members] - m_off, m_len) + np.arange(int(m_len.sum()))  # query row of each part row
    g_rows = np.array([int(q_lens[g.members].sum()) for g in groups], dtype=np.int64)
    g_pages = np.array([g.pages for g in groups], dtype=np.int64)
    p_qo, p_indptr = np.zeros(G + 1, dtype=np.int64), np.zeros(G + 1, dtype=np.int64)
    np.cumsum(g_rows, out=p_qo[1:])
    np.cumsum(g_pages, out=p_indptr[1:])
    p_indices = np.concatenate([indices[indptr[g.members[0]] : indptr[g.members[0]] + g.pages] for g in groups])
    p_last, p_kv = np.full(G, P, dtype=np.int64), g_pages * P
    Tp = int(p_qo[-1])
    identity = Tp == plan.num_tokens and bool((rows == np.arange(Tp)).all())
    i32 = dict(
        s_indptr=s_indptr,
        s_indices=s_indices,
        s_last=s_last,
        s_kv=kv_lens,
        p_qo=p_qo,
        p_indptr=p_indptr,
        p_indices=p_indices,
        p_last=p_last,
        p_kv=p_kv,
        g_rows=g_rows,
    )
    h, d = _packed(
        dev,
        {
            **{k: a.astype(np.int32) for k, a in i32.items()},
            **mask_arrays,
            **({} if identity else dict(rows=rows.astype(np.int64))),
        },
    )
    mask = plan.mask[d["m_idx"]] if masked else None
    suffix = Plan(
        config=cfg,
        mode=plan.mode,
        batch_size=B,
        num_tokens=plan.num_tokens,
        max_q_len=plan.max_q_len,
        max_kv_len=int(kv_lens.max()) if B else 0,
        causal=plan.causal,
        device=dev,
        qo_indptr=plan.qo_indptr,
        kv_indptr=d["s_indptr"],
        kv_indices=d["s_indices"],
        kv_last_page_len=d["s_last"],
        kv_lens=d["s_kv"],
        qo_indptr_cpu=plan.qo_indptr_cpu,
        kv_indptr_cpu=h["s_indptr"],
        kv_indices_cpu=h["s_indices"],
        kv_last_page_len_cpu=h["s_last"],
        q_lens_cpu=plan.q_lens_cpu,
        kv_lens_cpu=h["s_kv"],
        mask=mask,
        mask_indptr=d.get("m_indptr"),
        mask_indptr_cpu=h.get("m_indptr"),
        mask_free=d.get("m_free"),
        mask_free_cpu=h.get("m_free"),
        options=plan.options,
    )

    prefix = Plan(
        config=cfg,
        mode=ForwardMode.EXTEND,
        batch_size=G,
        num_tokens=Tp,
        max_q_len=int(g_rows.max()),
        max_kv_len=int(p_kv.max()),
        causal=False,
        device=dev,
        qo_indptr=d["p_qo"],
        kv_indptr=d["p_indptr"],
        kv_indices=d["p_indices"],
        kv_last_page_len=d["p_last"],
        kv_lens=d["p_kv"],
        qo_indptr_cpu=h["p_qo"],
        kv_indptr_cpu=h["p_indptr"],
        kv_indices_cpu=h["p_indices"],
        kv_last_page_len_cpu=h["p_last"],
        q_lens_cpu=h["g_rows"],
        kv_lens_cpu=h["p_kv"],
    )
    hd = (cfg.num_qo_heads, cfg.head_dim)
    return CascadePlan(
        groups=groups,
        suffix=suffix,
        prefix=prefix,
        rows=d.get("rows"),
        q_part=None if identity else torch.empty((Tp, *hd), dtype=cfg.dtype, device=dev),
        out_part=torch.empty((Tp, hd[0], cfg.head_dim_v), dtype=cfg.dtype, device=dev),
        lse_part=torch.empty((Tp, hd[0]), dtype=torch.float32, device=dev),
        lse_suffix=torch.empty((plan.num_tokens, hd[0]), dtype=torch.float32, device=dev),
    )


def plan_cascade(plan: Plan, mode: str) -> CascadePlan | None:
    """The cascade split of ``plan`` under ``mode`` (:func:`cascade_mode`), or ``None`` to run it whole."""
    if mode == "off" or plan.batch_size < 2:
        return None
    indptr, indices = plan.kv_indptr_cpu.numpy(), plan.kv_indices_cpu.numpy()
    if first_pages_repeat(indptr, indices) is None:
        return None
    groups = find_groups(indptr, indices, shareable_pages(plan), first_repeats=True)
    if not groups or (mode == "auto" and not cascade_pays(plan, groups)):
        return None
    return build_cascade_plan(plan, groups)


def _run_suffix(
    provider,
    plan: Plan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scratch_lse: torch.Tensor,
    scales: dict,
) -> torch.Tensor:
    """The suffix part into ``out``; returns the ``[T, Hq]`` LSE the prefix merge reads and updates: the caller's
    ``lse`` when given (written), else what :meth:`~attnplug.core.providers.base.Provider.run_lse` returns
    (``scratch_lse``, or the provider's own LSE where it has one)."""
    if lse is not None:
        provider.run(plan, q, k_cache, v_cache, out, lse, **scales)
        return lse
    return provider.run_lse(plan, q, k_cache, v_cache, out, scratch_lse, **scales)


def run_cascade(
    cp: CascadePlan,
    suffix_provider,
    prefix_provider,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    **scales,
) -> None:
    """``out [T, Hq, D]`` (+ natural-log ``lse [T, Hq]``) of the whole forward: the suffix part into
    ``out``, the prefix part into scratch, merged in place by LSE. Launches only (no host work).
    ``scales``: fp8 KV, the layer's scale tensors (``Provider.run``), for both parts; ``sinks`` (there): the
    parts run without it and it joins the merged state once."""
    from .kernels.merge import merge_state  # noqa: PLC0415 - triton is imported only when cascade runs

    sinks = scales.pop("sinks", None)  # both parts without the sink; it joins once, after their merge
    s_lse = _run_suffix(suffix_provider, cp.suffix, q, k_cache, v_cache, out, lse, cp.lse_suffix, scales)
    qp = q if cp.rows is None else torch.index_select(q, 0, cp.rows, out=cp.q_part)
    p_lse = prefix_provider.run_lse(cp.prefix, qp, k_cache, v_cache, cp.out_part, cp.lse_part, **scales)
    merge_state(out, s_lse, cp.out_part, p_lse, out, s_lse, rows=cp.rows)
    _join_sinks(out, s_lse, sinks)


def _join_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """The sink into the merged state ``(out, lse)`` in place
    (:func:`~attnplug.core.kernels.merge.apply_sinks`); nothing without sinks."""
    if sinks is not None:
        from .kernels.merge import apply_sinks  # noqa: PLC0415

        apply_sinks(out, lse, sinks)


# -- CUDA graphs -------------------------------------------------------------------------------------
def min_saved_pages(config, mode: str) -> int:
    """Pages a decode graph's shared prefix must save, ``(members - 1) * shared``, before the prefix
    part runs over it: :data:`MIN_SAVED_BYTES` of KV (``"auto"``), one page (``"always"``)."""
    if mode == "always":
        return 1
    per_token = (1 if config.is_mla else 2) * config.num_kv_heads * config.head_dim  # MLA: one latent row
    page_bytes = per_token * config.page_size * config.kv_dtype.itemsize
    return -(-MIN_SAVED_BYTES // page_bytes)


def graph_groups(
    kv_indptr: np.ndarray, kv_indices: np.ndarray, kv_lens: np.ndarray, page_size: int, q: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The groups of a graph replay's ``n`` requests (host twin of
    :func:`~attnplug.core.kernels.graph_update.shared_pages_kernel`): maximal runs of consecutive
    requests whose first page ids are equal, each with a shareable page (``(kv_len - q) // page_size``).
    Returns ``(start, end, found)`` ``[n]`` int64: request ``b``'s group is ``start[b]..end[b]-1``, whose
    members all share their first ``found[b]`` page ids (within each one's shareable pages; 0 for a
    group of one)."""
    n = kv_lens.shape[0]
    ind = kv_indptr.astype(np.int64)
    sh = np.maximum(kv_lens.astype(np.int64) - q, 0) // page_size
    first = kv_indices.take(ind[:-1], mode="clip") if kv_indices.size else np.zeros(n, dtype=np.int64)
    link = np.zeros(n, dtype=bool)
    link[1:] = (sh[1:] > 0) & (sh[:-1] > 0) & (first[1:] == first[:-1])
    heads = np.flatnonzero(~link)
    gid = np.cumsum(~link) - 1
    start, end = heads[gid], np.append(heads[1:], n)[gid]
    lim = np.minimum(sh, sh[start])
    found = np.where(end - start >= 2, lim, 0)
    m = int(found.max()) if n else 0
    if m:  # each member's first page id that differs from its group's first request's
        j = np.arange(m)
        top = kv_indices.size - 1
        diff = kv_indices[np.minimum(ind[:-1, None] + j, top)] != kv_indices[np.minimum(ind[start][:, None] + j, top)]
        diff &= j < lim[:, None]
        found = np.minimum(found, np.where(diff.any(axis=1), diff.argmax(axis=1), m))
    return start, end, (np.minimum.reduceat(found, heads)[gid] if n else found)


def graph_group_pages(start: np.ndarray, end: np.ndarray, found: np.ndarray, min_saved: int) -> np.ndarray:
    """``[n]`` int64: the pages cut from each request, its group's ``found`` where the group pays,
    ``(members - 1) * found >= min_saved``, else 0."""
    members = end - start
    return np.where((members >= 2) & (found > 0) & ((members - 1) * found >= min_saved), found, 0)


@dataclass
class CascadeSplitIn:
    """The cascade stage's input: one replay of the ``bs`` graph with ``batch`` (its ``n`` real requests,
    ``q`` tokens each) and the padded batch's page table as the update has it: ``host`` (the host
    CSR twin, :class:`~attnplug.core.graph_views.HostBatch`; ``None`` for a device CSR, which is not
    read back) or ``table`` (the engine's device page table, the one-launch update)."""

    bs: int
    n: int
    batch: BatchMetadata | None = None
    host: HostBatch | None = None
    table: DeviceTable | None = None


@dataclass
class CascadeSplitOut:
    """The cascade stage's output, what the static write reads. Host path: ``batch`` / ``host``, the
    real requests and the padded host twin without their cut pages (``pages [n]`` int64: pages cut
    from each; all zero: the inputs themselves). Device path: ``launch``, the cut of the one-launch
    write (:class:`~attnplug.core.kernels.graph_update.PrefixCut`: the groups on the device, the prefix
    batch and its tile list, the proof counters)."""

    batch: BatchMetadata | None = None
    host: HostBatch | None = None
    pages: np.ndarray | None = None
    launch: PrefixCut | None = None


def _mask_columns_from(kv_lens: torch.Tensor, q: int, cut: torch.Tensor) -> torch.Tensor:
    """``[sum q * (kv_len - cut)]`` int64: the flat positions, in a mask of ``[q, kv_len]`` blocks one a
    request (row-major, ``kv_lens [B]`` host), of every column from the request's ``cut [B]`` on."""
    kv = kv_lens.to(torch.int64)
    starts = torch.cumsum(kv * q, 0) - kv * q
    rows = torch.repeat_interleave(starts, q) + torch.arange(q).repeat(kv.numel()) * torch.repeat_interleave(kv, q)
    cut_r = torch.repeat_interleave(cut.to(torch.int64), q)
    keep = torch.repeat_interleave(kv, q) - cut_r
    return torch.repeat_interleave(rows + cut_r, keep) + (
        torch.arange(int(keep.sum())) - torch.repeat_interleave(torch.cumsum(keep, 0) - keep, keep)
    )


def cut_pages(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    mask: torch.Tensor | None,
    pages: torch.Tensor,
    q: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A host page CSR (``kv_indptr [B+1]``, ``kv_indices [nnz]``, ``kv_lens [B]``; verify: its
    row-major ``[q, kv_len]`` mask blocks, any device) without each request's first ``pages [B]`` int64
    pages: ``(kv_indptr [B+1] int32, kv_indices, kv_lens [B] int32, mask)``."""
    ind = kv_indptr.to(torch.int64)
    counts = ind[1:] - ind[:-1]
    pos = torch.arange(int(ind[-1])) - torch.repeat_interleave(ind[:-1], counts)  # page index within its request
    keep = pos >= torch.repeat_interleave(pages, counts)
    if mask is not None:  # each request's [q, kv_len] block loses its first pages * P columns
        mask = mask[_mask_columns_from(kv_lens, q, pages * page_size).to(mask.device)]
    shift = torch.zeros_like(ind)
    torch.cumsum(pages, 0, out=shift[1:])
    return (ind - shift).to(torch.int32), kv_indices[keep], (kv_lens - pages * page_size).to(torch.int32), mask


class CascadeGraph:
    """The shared-prefix part of a decode or verify :class:`~attnplug.core.cuda_graph.GraphState`: the
    requests of a replay fall into groups, maximal runs of consecutive requests starting on one page
    (:func:`graph_groups`); the leading pages all members of a group share (before their ``q`` query
    tokens: verify masks show every draft token the whole committed prefix) are read once, by one
    request of a non-causal prefix batch holding the group's query rows (contiguous), and merged with
    the suffix plan's output by LSE. The groups are found at each replay update from the page table
    (:meth:`split`: on the host from the host CSR; on the device from the engine's table, no sync); a
    group whose saving is below :func:`min_saved_pages` is not cut, and a batch with nothing cut runs
    an empty prefix part (its launch returns at once). Requests of one prompt that are not consecutive
    form separate groups.

    ``active`` (0-dim bool, device): the last update cut a prefix. ``counts [3]`` int64 (device): the
    updates that cut a shared prefix, the tokens they cut and the groups they cut, summed over this
    graph family's life without a host sync (the adapters' proof counters read the first two late).

    Static memory: the groups ``shared`` / ``group_start`` / ``group_end [max_batch]``; the prefix batch
    of ``bs + 1`` slots (slot ``g``: the group whose first request is ``g``; the last slot empty):
    ``qo_indptr`` / ``kv_indptr [max_batch+2]``, ``kv_indices [max_pages]``, ``kv_lens`` /
    ``kv_last_page_len [max_batch+1]`` (int32); per ``bs`` the prefix plan and its tile list (one tile
    list of ``bs * ceil(q / block_q)`` tiles the update writes, where the provider has one); the merge's
    ``out_part [max_tokens, Hq, D]``, ``lse_part`` / ``lse_suffix [max_tokens, Hq]`` float32.
    """

    def __init__(self, gs, mode: str):
        cfg, dev, P = gs.config, gs.device, gs.config.page_size
        self.gs, self.mode = gs, mode
        self.min_saved_pages = min_saved_pages(cfg, mode)
        self.max_pages = num_pages(gs.max_seq_len, P)
        mb = gs.max_batch
        i32 = dict(dtype=torch.int32, device=dev)
        self.shared = torch.zeros(mb, **i32)
        self.group_start = torch.zeros(mb, **i32)
        self.group_end = torch.zeros(mb, **i32)
        self.counts = torch.zeros(3, dtype=torch.int64, device=dev)
        self.update_counts = self.counts[:2]  # one view: readers key the counters they poll by identity
        self.active = torch.zeros((), dtype=torch.bool, device=dev)  # a prefix is cut: the IF node's predicate
        self.qo_indptr = torch.zeros(mb + 2, **i32)
        self.kv_indptr = torch.zeros(mb + 2, **i32)
        self.kv_indices = torch.zeros(max(gs.max_pages, self.max_pages), **i32)
        self.kv_lens = torch.zeros(mb + 1, **i32)
        self.kv_last_page_len = torch.zeros(mb + 1, **i32)
        self.plans: dict[int, Plan] = {}
        self.tiles: dict[int, GraphTiles | None] = {}
        hd = (mb * gs.q, cfg.num_qo_heads)
        self.out_part = torch.empty((*hd, cfg.head_dim_v), dtype=cfg.dtype, device=dev)
        self.lse_part = torch.empty(hd, dtype=torch.float32, device=dev)
        self.lse_suffix = torch.empty(hd, dtype=torch.float32, device=dev)
        self.provider = gs.provider.graph_prefix_provider()  # the prefix part's plans apart; its static memory below
        # one block_m for every bs (when the provider takes the knob): the tile lists of all bs are then
        # prefixes of one list in the static memory, of tiles of block_q query rows each
        self.tile_options, block_q = self.provider.fixed_tile_options(self._plan(mb))
        block_q = block_q or mb * gs.q
        # split partials for the largest tiles * block_q * splits(tiles) over the captured sizes
        rows = mb * gs.q
        self.static = self.provider.static_buffers(
            max_rows=num_pages(rows, block_q),
            max_tokens=rows,
            max_kv_len=gs.max_seq_len,
            q=block_q,
            num_kv_splits=gs.num_kv_splits,
            noncausal=True,
        )
        # a prefix provider whose plans cannot follow the groups of a replay is refused here, at startup
        self.provider.graph_tile_list(self._plan(mb), self.static, lambda bq: mb * -(-gs.q // bq))

    def _plan(self, bs: int) -> Plan:
        """The prefix plan of ``bs``: ``bs + 1`` slots over the static buffers; its host twins (what a
        provider sizes its tiles and splits by) are one slot of all ``bs * q`` rows over the longest prefix."""
        gs, P = self.gs, self.gs.config.page_size
        n = bs * gs.q  # query rows
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        rest = [0] * bs
        return Plan(
            config=gs.config,
            mode=ForwardMode.EXTEND,
            batch_size=bs + 1,
            num_tokens=n,
            max_q_len=n,
            max_kv_len=self.max_pages * P,
            causal=False,
            device=gs.device,
            qo_indptr=self.qo_indptr[: bs + 2],
            kv_indptr=self.kv_indptr[: bs + 2],
            kv_indices=self.kv_indices,
            kv_last_page_len=self.kv_last_page_len[: bs + 1],
            kv_lens=self.kv_lens[: bs + 1],
            qo_indptr_cpu=i32([0] + [n] * (bs + 1)),
            kv_indptr_cpu=i32([0] + [self.max_pages] * (bs + 1)),
            kv_indices_cpu=torch.zeros(self.max_pages, dtype=torch.int32),
            kv_last_page_len_cpu=i32([P] + rest),
            q_lens_cpu=i32([n] + rest),
            kv_lens_cpu=i32([self.max_pages * P] + rest),
        )

    def prepare_capture(self, bs: int) -> None:
        """The prefix plan of ``bs * q`` query rows in ``bs + 1`` slots, and its tile list (outside the graph)."""
        plan = self._plan(bs)
        tiles = self.tile_options if plan.max_q_len > 1 else {}
        plan.options = self.provider.pinned_options(tiles, self.gs.num_kv_splits)  # the static memory is sized by it
        q = self.gs.q
        self.tiles[bs] = self.provider.graph_tile_list(plan, self.static, lambda block_q: bs * -(-q // block_q))
        self.plans[bs] = plan

    def split(self, inp: CascadeSplitIn) -> CascadeSplitOut:
        """The cascade stage of one replay update (after the CSR, before the static write): the groups
        of the real requests and what each shares, from the host CSR (``inp.host``) or the engine's
        device table (``inp.table``: one launch, no sync); the host path writes the prefix batch here
        (the device path's write launch does) and returns the requests cut."""
        return self._split_device(inp) if inp.table is not None else self._split_host(inp)

    def _split_host(self, inp: CascadeSplitIn) -> CascadeSplitOut:
        """Host path: the groups of the real requests' host CSR (a device CSR: none, it is not read
        back), the prefix batch of those that pay, and ``batch`` / ``host`` without their pages
        (verify: and their mask columns)."""
        h, batch, n, bs = inp.host, inp.batch, inp.n, inp.bs
        P, q = self.gs.config.page_size, self.gs.q
        ar = np.arange(n, dtype=np.int64)
        start, end, found = ar, ar + 1, np.zeros(n, dtype=np.int64)
        if h is not None and batch.kv_indices.device.type == "cpu":
            kv = h.kv_lens[:n].numpy()
            start, end, found = graph_groups(h.kv_indptr[: n + 1].numpy(), h.kv_indices.numpy(), kv, P, q)
        pages = graph_group_pages(start, end, found, self.min_saved_pages)
        self._write_prefix(inp, start, end, found, pages)
        if not pages.any():
            return CascadeSplitOut(batch=batch, host=h, pages=pages)
        cut = torch.from_numpy(pages)
        ind, idx, _, mask = cut_pages(batch.kv_indptr, batch.kv_indices, h.kv_lens[:n], batch.custom_mask, cut, q, P)
        suffix = BatchMetadata(batch.mode, batch.qo_indptr, ind, idx, batch.kv_last_page_len, custom_mask=mask)
        padded = torch.cat([cut, torch.zeros(bs - n, dtype=torch.int64)])
        h_ind, h_idx, h_kv, h_mask = cut_pages(h.kv_indptr, h.kv_indices, h.kv_lens, h.mask, padded, q, P)
        host = dataclasses.replace(h, kv_indptr=h_ind, kv_indices=h_idx, kv_lens=h_kv, mask=h_mask)
        if h.mask_indptr is not None:
            host.mask_indptr, host.mask_free = indptr_from_counts(h_kv.long() * q, torch.int64), h_kv - q
        return CascadeSplitOut(batch=suffix, host=host, pages=pages)

    def _write_prefix(
        self, inp: CascadeSplitIn, start: np.ndarray, end: np.ndarray, found: np.ndarray, pages: np.ndarray
    ) -> None:
        """Host path: the groups, the prefix batch (slot ``g``: the rows of the group whose first
        request is ``g``, over its cut pages), its tile list and the proof counters, as the device
        path's write launch writes them."""
        bs, n, q, P = inp.bs, inp.n, self.gs.q, self.gs.config.page_size
        r = np.arange(bs, dtype=np.int64)
        st, en = np.concatenate([start, r[n:]]), np.concatenate([end, r[n:] + 1])
        lead = st == r
        c = np.where(lead, np.concatenate([pages, r[n:] * 0]), 0)
        qo = np.full(bs + 2, bs * q, dtype=np.int64)
        qo[:bs] = q * np.where(lead, r, en)
        p_ind = np.zeros(bs + 2, dtype=np.int64)
        np.cumsum(c, out=p_ind[1 : bs + 1])
        p_ind[bs + 1] = p_ind[bs]
        total = int(p_ind[bs])
        i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        nb = dict(non_blocking=True)
        self.shared[:n].copy_(i32(np.where(start == np.arange(n), found, 1 << 30)), **nb)
        self.group_start[:n].copy_(i32(start), **nb)
        self.group_end[:n].copy_(i32(end), **nb)
        self.qo_indptr[: bs + 2].copy_(i32(qo), **nb)
        self.kv_indptr[: bs + 2].copy_(i32(p_ind), **nb)
        self.kv_lens[: bs + 1].copy_(i32(np.append(c * P, 0)), **nb)
        self.kv_last_page_len[: bs + 1].copy_(i32(np.append(np.where(c > 0, P, 0), 0)), **nb)
        if total:
            h = inp.host
            ind = h.kv_indptr.numpy().astype(np.int64)
            g = np.flatnonzero(c)
            idx = np.repeat(ind[g], c[g]) + np.arange(total) - np.repeat(p_ind[g], c[g])
            self.kv_indices[:total].copy_(h.kv_indices[torch.from_numpy(idx)].to(torch.int32), **nb)
        tiles = self.tiles.get(bs)
        if tiles is not None:
            tile_req, tile_q, block_q, tile_count = tiles
            t = np.where((c > 0) if tile_count is not None else lead, -(-(en - r) * q // block_q), 0)
            k = int(t.sum())
            req, qs = np.full(tile_req.numel(), bs, dtype=np.int64), np.zeros(tile_req.numel(), dtype=np.int64)
            req[:k] = np.repeat(r, t)
            qs[:k] = (np.arange(k) - np.repeat(np.cumsum(t) - t, t)) * block_q
            tile_req.copy_(i32(req), **nb)
            tile_q.copy_(i32(qs), **nb)
            if tile_count is not None:
                tile_count.copy_(i32([k]), **nb)
        groups = int((c > 0).sum())
        self.active.fill_(groups > 0)
        if groups:
            self.counts.add_(torch.tensor([1, total * P, groups], dtype=torch.int64).to(self.counts.device))

    def _split_device(self, inp: CascadeSplitIn) -> CascadeSplitOut:
        """Device path: the groups of the engine's table and what each shares (one launch,
        :func:`~attnplug.core.kernels.graph_update.batch_shared_pages`); the write launch cuts those
        that clear :attr:`min_saved_pages` and writes the prefix batch and its tile list."""
        from .kernels.graph_update import PrefixCut, batch_shared_pages  # noqa: PLC0415

        t = inp.table
        batch_shared_pages(
            t.seq_lens,
            t.block_table,
            self.gs.config.page_size,
            self.shared,
            self.group_start,
            self.group_end,
            row_ids=t.row_ids,
            entry_tokens=t.entry_tokens,
            q=self.gs.q,
            max_batch=self.gs.max_batch,
        )
        # the buffers by their names (the cut's fields are this object's static memory), the bs's tile list
        bufs = {f.name: getattr(self, f.name) for f in dataclasses.fields(PrefixCut) if f.name != "tiles"}
        return CascadeSplitOut(launch=PrefixCut(**bufs, tiles=self.tiles.get(inp.bs)))

    def run(
        self,
        bs: int,
        suffix: Plan,
        suffix_provider,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        **scales,
    ) -> None:
        """``out [bs * q, Hq, D]``: the suffix plan, then the prefix plan merged into it by LSE
        (:meth:`~attnplug.core.providers.base.Provider.run_merge`; launches only). Captured with
        ``ATTNPLUG_GRAPH_IF=1``, the prefix part sits in an IF node on :attr:`active`
        (:func:`~attnplug.core.graph_if.captured_if`): a replay whose batch shares nothing skips it."""
        sinks = scales.pop("sinks", None)  # both parts without the sink; it joins once, after the IF node
        n = bs * self.gs.q
        s_lse = _run_suffix(suffix_provider, suffix, q, k_cache, v_cache, out, lse, self.lse_suffix[:n], scales)
        with captured_if(self.active):
            self.provider.run_merge(
                self.plans[bs], q, k_cache, v_cache, out, s_lse, self.out_part[:n], self.lse_part[:n], **scales
            )
        _join_sinks(out, s_lse, sinks)
