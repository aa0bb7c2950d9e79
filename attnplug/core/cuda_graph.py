"""CUDA-graph hooks of the core: static metadata buffers, capture-time plans, in-place replay updates.

    gs = GraphState(config, "triton", max_batch=64, max_tokens=64, max_pages=20000, device="cuda")
    plan = gs.prepare_capture(bs)                 # outside the graph (host work allowed)
    with torch.cuda.graph(g): gs.run(bs, q[:bs], k_cache, v_cache, out[:bs])
    ...
    gs.update(batch, bs)                          # replay time: in-place writes only
    gs.update_from_block_table(seq_lens, block_table, bs)   # or: from a device block table, one launch
    g.replay()

Padding: a replay batch of ``B <= bs`` requests fills requests ``B..bs-1`` with a *padded
request*: committed length :data:`FILL_SEQ_LEN` (= 1, SGLang's ``get_cuda_graph_seq_len_fill_value``),
so ``kv_len = 1`` (decode) or ``1 + num_draft_tokens`` (verify), every page of it = ``pad_page`` (a
page the engine reserves as scratch; its content only reaches the padded output rows), last-page
length accordingly, an all-True mask block (verify). Padded rows read valid memory only and write
only their own output rows ``B*q..bs*q-1``.

``GraphState`` owns the provider-neutral buffers (page CSR, lengths, verify mask). ``update`` writes
the real batch with ``copy_`` (host inputs: ``non_blocking``, pin them for a truly asynchronous copy;
device inputs: device-to-device) and the padded/derived slots with in-place ops (``fill_``, ``out=``):
no buffer is reallocated and nothing reads device values on the host. Everything specific to the
provider - its own static memory, its capture-time plan, its refresh before a replay (FA3's block
table, FlashInfer's host re-plan) and what it cannot replay - is the provider's
:class:`~attnplug.core.providers.base.ProviderGraph`.

Fixed at capture: the provider's launch arguments (e.g. triton's tile list and split count),
``mask_free = kv_len - q`` in verify mode (the prefix must be visible to every draft token, as
:func:`~attnplug.core.draft.build_tree_verify_mask` builds it and SGLang/FA3 assume; checked where
the mask is on the host), ``max_seq_len`` as every request's key bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cascade import CascadeGraph, CascadeSplitIn, CascadeSplitOut, cascade_mode
from .config import AttentionConfig, UnsupportedFeature
from .graph_views import DeviceTable, HostBatch, StaticViews
from .metadata import BatchMetadata, ForwardMode
from .pages import indptr_from_counts, last_page_len, num_pages, tokens_from_pages
from .plan import Plan, _leading_visible_columns
from .providers import Provider, provider_instance

if TYPE_CHECKING:
    from .kernels.graph_update import PrefixCut

FILL_SEQ_LEN = 1  # committed length of a padded request (SGLang's CUDA-graph seq-len fill value)
_I32 = torch.int32


def chain_mask(q: int, kv_len: int) -> torch.Tensor:
    """``[q, kv_len]`` bool causal-chain verify mask: row ``i`` sees columns ``c <= kv_len - q + i``."""
    return torch.arange(kv_len)[None, :] <= (kv_len - q + torch.arange(q))[:, None]


class GraphState:
    """Static buffers of one graph family (one forward mode), shared by every captured batch size.

    Args:
        config: attention config.
        provider: a registered provider name, class or instance whose ``graph_support`` covers ``mode``
            (the config's one instance, forked: this family's plans apart, its resources shared).
        max_batch: largest padded batch size ``bs``.
        max_tokens: largest ``bs * q`` (``q = 1`` decode, ``num_draft_tokens`` verify).
        max_pages: largest number of pages of the real requests of one batch (sum over requests).
        device: device of the buffers.
        mode: ``"decode"`` or ``"verify"`` (TARGET_VERIFY with a custom tree mask).
        num_draft_tokens: ``q`` per request in verify mode.
        pad_page: page id padded requests read.
        max_seq_len: largest ``kv_len`` of one request (default ``max_pages * page_size``).
        num_kv_splits: split-KV count under graphs, for providers that split (default: theirs).
        chain: verify mode whose masks are causal chains (``c <= kv_len - q + i``: vLLM's linear spec
            decode, what :meth:`update_from_block_table` writes): a provider may replay it with a causal
            kernel instead of reading the mask (``GraphSupport.chain_verify``); :meth:`update` checks a
            host mask is one.
        cascade: shared-prefix attention, ``"off"`` / ``"auto"`` / ``"always"``
            (:class:`~attnplug.core.cascade.CascadeGraph`: each update finds the groups of consecutive
            real requests starting on one page and the leading pages each group shares before their
            ``q`` tokens; the captured launches read them once a group; the graph of one request has
            no cascade part). Verify: cut where the update reads a host
            page CSR (and mask) or a device page table (chain masks); a device CSR cuts nothing.

    Raises:
        UnsupportedFeature: the provider cannot replay ``mode`` (its ``graph_support`` says why), or
            ``cascade`` is on where the provider's graphs cannot run it.
    """

    def __init__(
        self,
        config: AttentionConfig,
        provider: str | type[Provider] | Provider,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        device: torch.device | str = "cuda",
        mode: str = "decode",
        num_draft_tokens: int = 1,
        pad_page: int = 0,
        max_seq_len: int | None = None,
        num_kv_splits: int | None = None,
        cascade: str = "off",
        chain: bool = False,
    ):
        if mode not in ("decode", "verify"):
            raise ValueError(f"mode must be 'decode' or 'verify', got {mode!r}")
        self.config, self.mode, self.device = config, mode, torch.device(device)
        self.chain = chain and mode == "verify"
        self.q = 1 if mode == "decode" else int(num_draft_tokens)
        if max_batch * self.q > max_tokens:
            raise ValueError(f"max_tokens must be >= max_batch * q = {max_batch * self.q}, got {max_tokens}")
        self.max_batch, self.max_tokens, self.max_pages, self.pad_page = max_batch, max_tokens, max_pages, pad_page
        P = config.page_size
        self.max_seq_len = max_seq_len or max_pages * P
        self.num_kv_splits = num_kv_splits
        self.provider = provider_instance(provider, config, self.device).fork()
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=self.device) if config.kv_quantized else None
        self.pad_kv_len = FILL_SEQ_LEN + (self.q if mode == "verify" else 0)
        self.pad_pages = num_pages(self.pad_kv_len, P)
        self.pad_last = last_page_len(self.pad_kv_len, P)
        dev, mb = self.device, max_batch
        i32 = dict(dtype=_I32, device=dev)
        self.qo_indptr = torch.arange(mb + 1, **i32) * self.q  # constant: q tokens per request
        self.kv_indptr = torch.zeros(mb + 1, **i32)
        self.kv_indices = torch.full((max_pages + mb * self.pad_pages,), pad_page, **i32)
        self.kv_last_page_len = torch.zeros(mb, **i32)
        self.kv_lens = torch.zeros(mb, **i32)
        self._pad_indptr = torch.arange(1, mb + 1, **i32) * self.pad_pages  # offsets of padded requests
        self.mask = self.mask_indptr = self.mask_free = None
        self.max_mask = 0
        if mode == "verify":
            self.max_mask = self.q * (max_pages * P + mb * self.pad_kv_len)
            self.mask = torch.ones(self.max_mask, dtype=torch.uint8, device=dev)
            self.mask_indptr = torch.zeros(mb + 1, dtype=torch.int64, device=dev)
            self.mask_free = torch.zeros(mb, **i32)
        self.plans: dict[int, Plan] = {}
        self.graph = self.provider.graph(self)  # the provider's static state; raises if it cannot replay mode
        self.cascade = None
        if cascade_mode(cascade) != "off":
            if not self.provider.graph_support.cascade:
                raise UnsupportedFeature(
                    f"attnplug: provider '{self.provider.name}' does not support shared-prefix "
                    f"(cascade) attention in CUDA graphs of {mode} batches"
                )
            self.cascade = CascadeGraph(self, cascade_mode(cascade))

    @property
    def needs_host_lengths(self) -> bool:
        """A replay refresh needs host ``kv_indptr`` / ``kv_last_page_len`` (the provider plans on the host)."""
        return not self.provider.graph_support.device_refresh

    # -- helpers -----------------------------------------------------------------------------------
    def static_views(self, bs: int) -> StaticViews:
        """The static buffers as the ``bs`` batch's plan sees them (verify: with the mask's)."""
        v = StaticViews(
            qo_indptr=self.qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            kv_last_page_len=self.kv_last_page_len[:bs],
            kv_lens=self.kv_lens[:bs],
        )
        if self.mode == "verify":
            v.mask, v.mask_indptr, v.mask_free = self.mask, self.mask_indptr[: bs + 1], self.mask_free[:bs]
        return v

    def _padded_host(self, batch: BatchMetadata, bs: int) -> HostBatch | None:
        """Host twins of the padded batch (``None`` when the inputs live on the device)."""
        if batch.kv_indptr.device.type != "cpu" or batch.kv_last_page_len.device.type != "cpu":
            return None
        pad, P = bs - batch.batch_size, self.config.page_size
        n = int(batch.kv_indices.numel())
        ind = torch.cat([batch.kv_indptr.to(_I32), n + torch.arange(1, pad + 1, dtype=_I32) * self.pad_pages])
        idx = torch.cat(
            [batch.kv_indices.cpu().to(_I32), torch.full((pad * self.pad_pages,), self.pad_page, dtype=_I32)]
        )
        last = torch.cat([batch.kv_last_page_len.to(_I32), torch.full((pad,), self.pad_last, dtype=_I32)])
        kv_lens = tokens_from_pages(ind[1:] - ind[:-1], last, P).to(_I32)
        h = HostBatch(
            qo_indptr=torch.arange(bs + 1, dtype=_I32) * self.q,
            kv_indptr=ind,
            kv_indices=idx,
            kv_last_page_len=last,
            kv_lens=kv_lens,
            q_lens=torch.full((bs,), self.q, dtype=_I32),
        )
        if self.mode == "verify":
            h.mask_indptr, h.mask_free = indptr_from_counts(kv_lens.long() * self.q, torch.int64), kv_lens - self.q
            if batch.custom_mask is not None and batch.custom_mask.device.type == "cpu":
                tail = torch.ones(int(h.mask_indptr[-1]) - batch.custom_mask.numel(), dtype=torch.bool)
                h.mask = torch.cat([batch.custom_mask.bool(), tail]).to(torch.uint8)
                self._check_prefix_visible(h, bs)
                if self.chain:
                    self._check_chain(h, batch.batch_size)
        return h

    def _check_prefix_visible(self, h: HostBatch, bs: int) -> None:
        """The verify graphs' contract, checked where the mask is on the host (capture, CPU): every
        draft token sees the whole committed prefix (``mask_free = kv_len - q``; the kernels skip
        the mask there). A device mask (a replay) is not read back: that would sync."""
        free = _leading_visible_columns(h.mask, h.mask_indptr, h.q_lens, h.kv_lens)
        hidden = torch.nonzero(free < h.mask_free)
        if hidden.numel():
            b = int(hidden[0])
            raise UnsupportedFeature(
                f"attnplug: provider '{self.provider.name}' CUDA-graph verify needs every draft token to see the "
                f"whole committed prefix; request {b}'s mask hides prefix column {int(free[b])} "
                f"of {int(h.mask_free[b])}"
            )

    def _check_chain(self, h: HostBatch, n: int) -> None:
        """A chain family's contract, checked where the mask is on the host: the ``n`` real requests'
        masks are causal chains (row ``i`` of a request sees columns ``c <= kv_len - q + i``)."""
        for b in range(n):
            kv, lo = int(h.kv_lens[b]), int(h.mask_indptr[b])
            m = h.mask[lo : lo + self.q * kv].view(self.q, kv).bool()
            if not torch.equal(m, chain_mask(self.q, kv)):
                raise UnsupportedFeature(
                    f"attnplug: provider '{self.provider.name}' CUDA-graph verify family of causal chains "
                    f"(chain=True) got a tree mask for request {b}: use a family with chain=False"
                )

    def _host_csr(self, seq_lens: torch.Tensor, bs: int) -> HostBatch:
        """Host ``kv_indptr [bs+1]`` / ``kv_last_page_len [bs]`` of the padded batch of ``seq_lens [n]``
        (the same padding as the kernel: ``<= 0`` and rows ``n..bs-1`` are padded requests), with
        ``kv_indices`` the device buffer's used prefix."""
        P, n = self.config.page_size, seq_lens.shape[0]
        s = torch.full((bs,), self.pad_kv_len, dtype=_I32)
        host = seq_lens.cpu()
        s[:n] = torch.where(host > 0, host, self.pad_kv_len).to(_I32)
        ind = indptr_from_counts(num_pages(s, P))
        return HostBatch(
            kv_indptr=ind, kv_indices=self.kv_indices[: int(ind[-1])], kv_last_page_len=last_page_len(s, P)
        )

    # -- capture / replay --------------------------------------------------------------------------
    def prepare_capture(self, bs: int, batch: BatchMetadata | None = None) -> Plan:
        """Plan of a padded batch of size ``bs`` (``batch``: its first requests; default: all padding).

        Call outside the graph; the returned plan is what :meth:`run` launches under capture and what
        :meth:`update` refreshes in place later.
        """
        if not 1 <= bs <= self.max_batch:
            raise ValueError(f"bs must be in 1..max_batch={self.max_batch}, got {bs}")
        if batch is None:
            z = torch.zeros(1, dtype=_I32)
            mask = torch.zeros(0, dtype=torch.bool) if self.mode == "verify" else None
            mode = ForwardMode.DECODE if self.mode == "decode" else ForwardMode.TARGET_VERIFY
            batch = BatchMetadata(mode, z, z, torch.zeros(0, dtype=_I32), torch.zeros(0, dtype=_I32), custom_mask=mask)
        h = self._padded_host(batch, bs)
        if h is None:
            raise ValueError("prepare_capture needs host metadata (it runs outside the graph)")
        plan = Plan(
            config=self.config,
            mode=ForwardMode.DECODE if self.mode == "decode" else ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            num_tokens=bs * self.q,
            max_q_len=self.q,
            max_kv_len=self.max_seq_len,
            causal=self.mode == "decode",
            device=self.device,
            qo_indptr_cpu=h.qo_indptr,
            kv_indptr_cpu=h.kv_indptr,
            kv_indices_cpu=h.kv_indices,
            kv_last_page_len_cpu=h.kv_last_page_len,
            q_lens_cpu=h.q_lens,
            kv_lens_cpu=h.kv_lens,
            mask_indptr_cpu=h.mask_indptr,
            mask_free_cpu=h.mask_free,
            **self.static_views(bs).plan_fields(),
        )
        self.plans[bs] = plan
        self.graph.plan(plan, bs)
        if self._cascade(bs) is not None:
            self.cascade.prepare_capture(bs)
        self.update(batch, bs)
        return plan

    def _cascade(self, bs: int) -> CascadeGraph | None:
        """The cascade part of the ``bs`` graph: none for one request (nothing to share, so the graph
        of one request carries no prefix launches)."""
        return self.cascade if bs >= 2 else None

    @property
    def cascade_counts(self) -> torch.Tensor | None:
        """``[2]`` int64 on the device: updates that cut a shared prefix, tokens cut (summed over the
        groups; None without cascade). The groups cut: ``cascade.counts[2]``."""
        return None if self.cascade is None else self.cascade.update_counts

    def update(self, batch: BatchMetadata, bs: int | None = None) -> Plan:
        """Write ``batch`` (``B <= bs`` requests, ``q`` tokens each) into the static buffers of the
        plan captured for ``bs`` (default: the smallest captured ``bs >= B``), padding ``B..bs-1``.

        One pass of stages, each once: the page table (:meth:`_page_table`: which plan, capacities),
        the CSR (:meth:`_padded_host`: the padded batch's host twin, where the inputs are on the host),
        the cascade split (:meth:`_cascade_split`), the static write of what is left (:meth:`_write`),
        the provider's refresh. Only the prefix ``[:bs+1]`` / ``[:bs]`` of the per-request buffers,
        ``kv_indices[:nnz + (bs-B)*pad_pages]`` and (verify) ``mask[:sum q*kv_len]`` are written.
        """
        bs = self._page_table(batch, bs)
        host = self._padded_host(batch, bs)
        cut = self._cascade_split(CascadeSplitIn(bs, batch.batch_size, batch=batch, host=host))
        plan = self.plans[bs]
        self._write(cut.batch, bs)
        if cut.host is not None:  # keep the host twins current (reference checks, host-planning providers)
            h = cut.host
            plan.kv_indptr_cpu, plan.kv_indices_cpu = h.kv_indptr, h.kv_indices
            plan.kv_last_page_len_cpu, plan.kv_lens_cpu = h.kv_last_page_len, h.kv_lens
            if self.mode == "verify":
                plan.mask_indptr_cpu, plan.mask_free_cpu = h.mask_indptr, h.mask_free
        self.graph.refresh(plan, bs, cut.host, device_table=False)
        return plan

    def _page_table(self, batch: BatchMetadata, bs: int | None) -> int:
        """Stage 1 of :meth:`update`: the captured ``bs`` that takes ``batch`` (default: the smallest
        ``>= B``), its request and page counts checked against the capacities."""
        B = batch.batch_size
        if bs is None:
            fits = [s for s in self.plans if s >= B]
            if not fits:
                raise ValueError(f"no captured batch size >= {B}; captured: {sorted(self.plans)}")
            bs = min(fits)
        if bs not in self.plans:
            raise KeyError(bs)
        if B > bs:
            raise ValueError(f"batch has {B} requests > bs={bs}")
        n = int(batch.kv_indices.numel())
        if n > self.max_pages:
            raise ValueError(f"batch needs {n} pages > max_pages={self.max_pages}")
        return bs

    def _cascade_split(self, inp: CascadeSplitIn) -> CascadeSplitOut:
        """Stage 3: the cascade part's split (:meth:`CascadeGraph.split`); without one, the inputs as they are."""
        c = self._cascade(inp.bs)
        if c is None:
            return CascadeSplitOut(batch=inp.batch, host=inp.host)
        return c.split(inp)

    def _write(self, batch: BatchMetadata, bs: int) -> None:
        """The static write of :meth:`update`: ``batch``'s real requests by ``copy_`` (host inputs
        ``non_blocking``), the padded requests and the derived buffers by in-place ops."""
        B, n = batch.batch_size, int(batch.kv_indices.numel())
        pad, P, q = bs - B, self.config.page_size, self.q
        nb = dict(non_blocking=True)
        # real requests
        self.kv_indptr[: B + 1].copy_(batch.kv_indptr, **nb)
        self.kv_indices[:n].copy_(batch.kv_indices, **nb)
        self.kv_last_page_len[:B].copy_(batch.kv_last_page_len, **nb)
        # padded requests: pad_pages pages of pad_page each, after the real pages
        torch.add(self._pad_indptr[:pad], n, out=self.kv_indptr[B + 1 : bs + 1])
        self.kv_indices[n : n + pad * self.pad_pages].fill_(self.pad_page)
        self.kv_last_page_len[B:bs].fill_(self.pad_last)
        # derived, in place: kv_len = (num_pages - 1) * P + last (0 without pages)
        kl = self.kv_lens[:bs]
        torch.sub(self.kv_indptr[1 : bs + 1], self.kv_indptr[:bs], out=kl)
        kl.sub_(1).mul_(P).add_(self.kv_last_page_len[:bs]).clamp_(min=0)
        if self.mode == "verify":
            m = int(batch.custom_mask.numel())
            if m + pad * q * self.pad_kv_len > self.max_mask:
                raise ValueError(f"custom_mask of {m} elements exceeds capacity {self.max_mask}")
            self.mask[:m].copy_(batch.custom_mask, **nb)
            self.mask[m : m + pad * q * self.pad_kv_len].fill_(1)
            mi = self.mask_indptr[1 : bs + 1]
            torch.cumsum(kl, 0, out=mi)
            mi.mul_(q)
            torch.sub(kl, q, out=self.mask_free[:bs])

    def update_from_block_table(
        self,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        bs: int,
        row_ids: torch.Tensor | None = None,
        entry_tokens: int = 1,
        host_seq_lens: torch.Tensor | None = None,
        custom_mask: torch.Tensor | None = None,
    ) -> Plan:
        """Replay-time update from the block-table form (vLLM's), in one Triton launch on the device.

        Args:
            seq_lens: ``[n]`` (``n <= bs``) KV length per request, this step's ``q`` tokens included;
                ``<= 0`` (and rows ``n..bs-1``): padded request.
            block_table: ``[rows, W]`` page ids, any strides; request ``b`` reads row ``b`` or ``row_ids[b]``.
            bs: a captured batch size.
            row_ids: optional ``[n]`` table row per request (SGLang's ``req_pool_indices``).
            entry_tokens: ``page_size`` for a token-slot table (SGLang's ``req_to_token``: page ``j`` is
                ``table[row, j * P] // P``), 1 for a page table (vLLM's block table).
            host_seq_lens: ``[n]`` host copy of ``seq_lens``; required when :attr:`needs_host_lengths`
                (the provider re-plans on the host from ``kv_indptr`` / ``kv_last_page_len``, with
                ``kv_indices`` the device buffer this launch wrote: no sync). The launch then reads
                these host lengths (copied over), so plan and buffers cannot disagree.
            custom_mask: verify mode, a family of tree masks (``chain=False``) whose provider refreshes on
                the device: the engine's masks (SGLang's ``custom_mask``: request ``b``'s row-major ``[q,
                seq_lens[b]]`` block after those of the requests before it); their tree parts (last ``q``
                columns) are copied, the committed prefix is visible (the verify graphs' contract, not
                read back). ``None``: causal chains.

        Writes what :meth:`update` writes (verify mode: ``custom_mask``'s tree parts, or the causal-chain
        mask ``c <= kv_len - q + i``, vLLM's linear spec decode) plus the provider's block
        table if it has one, with no host sync and no allocation (a host-planning provider aside);
        the plan's host twins are left as they were. Each request must fit ``max_seq_len``. The same
        stages as :meth:`update`: the page table (:class:`DeviceTable`), the CSR (host lengths where
        the provider plans on the host), the cascade split (on the device), the static write (one
        launch: the CSR of what is left, and the prefix batch), the provider's refresh.
        """
        if bs not in self.plans:
            raise ValueError(f"bs={bs} was not captured; captured: {sorted(self.plans)}")
        if custom_mask is not None and (self.mode != "verify" or self.chain or self.needs_host_lengths):
            raise ValueError(
                "custom_mask: tree masks from a device page table need a verify family with chain=False "
                f"whose provider refreshes on the device (mode {self.mode}, chain {self.chain}, provider "
                f"'{self.provider.name}' plans on the host: {self.needs_host_lengths}); use update()"
            )
        host = None
        if self.needs_host_lengths:
            self.graph.check_device_table_update(host_seq_lens)
            seq_lens = host_seq_lens.to(self.device, non_blocking=True)  # buffers and host plan agree
            host = self._host_csr(host_seq_lens, bs)
        table = DeviceTable(seq_lens, block_table, row_ids, entry_tokens)
        n = seq_lens.shape[0]
        cut = self._cascade_split(CascadeSplitIn(bs, n, table=table))
        self._write_from_table(table, bs, cut.launch, custom_mask)
        self.graph.refresh(self.plans[bs], bs, host, device_table=True)
        return self.plans[bs]

    def _write_from_table(
        self, t: DeviceTable, bs: int, cascade: PrefixCut | None, tree_mask: torch.Tensor | None
    ) -> None:
        """The static write of :meth:`update_from_block_table`: one launch
        (:func:`~attnplug.core.kernels.graph_update.graph_batch_from_block_table`), ``cascade`` its cut
        (:class:`~attnplug.core.cascade.CascadeSplitOut`'s ``launch``; ``None``: no cascade part),
        ``tree_mask`` the engine's verify masks (``None``: causal chains)."""
        from .kernels.graph_update import graph_batch_from_block_table  # noqa: PLC0415

        v = self.static_views(bs)
        verify = self.mode == "verify"
        graph_batch_from_block_table(
            t.seq_lens,
            t.block_table,
            bs,
            self.config.page_size,
            self.pad_page,
            self.pad_kv_len,
            v.kv_indptr,
            self.kv_indices,
            v.kv_last_page_len,
            v.kv_lens,
            block_table_out=self.graph.block_table,
            q=self.q,
            mask=self.mask if verify else None,
            mask_indptr=v.mask_indptr,
            mask_free=v.mask_free,
            max_batch=self.max_batch,
            row_ids=t.row_ids,
            entry_tokens=t.entry_tokens,
            cut=cascade,
            tree_mask=tree_mask,
        )

    def run(
        self,
        bs: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        host_scales: tuple[float, float] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Launch the ``bs`` plan: ``q [bs*q, Hq, D]`` -> ``out [bs*q, Hq, D]``; no host work (capturable).
        fp8 KV: the layer's scales as in ``PagedAttention.run`` (device tensors: captured, updated in place;
        ``host_scales``: captured as values). ``sinks [Hq]``: as in ``PagedAttention.run`` (captured)."""
        scales = self.config.scale_kwargs(self._unit_scale, k_scale, v_scale, q_scale, host_scales)
        scales.update(self.config.sink_kwargs(sinks))
        if self._cascade(bs) is not None:
            self.cascade.run(bs, self.plans[bs], self.provider, q, k_cache, v_cache, out, lse, **scales)
        else:
            self.provider.run(self.plans[bs], q, k_cache, v_cache, out, lse, **scales)
        return out
