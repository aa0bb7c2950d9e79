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

``update`` writes the real batch with ``copy_`` (host inputs: ``non_blocking``, pin them for a truly
asynchronous copy; device inputs: device-to-device) and the padded/derived slots with in-place ops
(``fill_``, ``out=``) on the static buffers: no buffer is reallocated and nothing reads device
values on the host. Sizes come from tensor shapes (``B``, ``nnz``). Exceptions (provider APIs):
FlashInfer needs host ``kv_indptr``/``kv_last_page_len`` and re-plans its wrapper (its documented
replay path, copies into the fixed buffers; for a custom mask FlashInfer itself syncs to pack bits).

Fixed at capture (python launch arguments): the triton tile list (``bs * ceil(q/BLOCK_Q)`` tiles),
its split count (``num_kv_splits`` or the heuristic at ``max_seq_len``), ``mask_free = kv_len - q``
in verify mode (the prefix must be visible to every draft token, as :func:`build_tree_verify_mask`
builds it and SGLang/FA3 assume); FA3's ``max_seqlen_k = max_seq_len``. fa3 verify: FA3 on the prefix
(``seqused_k = mask_free``, the static view), attnplug's Triton kernel on the tree part (keys from
``kv_start = mask_free``, static tiles, one split), LSE-merged into ``out``.
"""

from __future__ import annotations

import os

import torch

from .config import AttentionConfig, UnsupportedFeature
from .metadata import BatchMetadata, ForwardMode
from .plan import Plan, _leading_visible_columns
from .providers import get_provider_cls

FILL_SEQ_LEN = 1  # committed length of a padded request (SGLang's CUDA-graph seq-len fill value)
_I32 = torch.int32
# Opt-in until run on a GPU: FlashInfer decode replays from a device page table
# (update_from_block_table + host lengths): SGLang without the device->host read of kv_indices,
# vLLM with FULL decode graphs. Off: the replay paths measured on the H200.
FLASHINFER_DEVICE_REPLAY_ENV = "ATTNPLUG_FLASHINFER_DEVICE_REPLAY"


def flashinfer_device_replay() -> bool:
    """``ATTNPLUG_FLASHINFER_DEVICE_REPLAY=1``: the engines use FlashInfer's device-table replay."""
    return os.environ.get(FLASHINFER_DEVICE_REPLAY_ENV, "0") == "1"


class GraphState:
    """Static buffers of one graph family (one forward mode), shared by every captured batch size.

    Args:
        config: attention config.
        provider: ``"triton"``, ``"flashinfer"`` or ``"fa3"`` (``"reference"`` cannot be captured).
        max_batch: largest padded batch size ``bs``.
        max_tokens: largest ``bs * q`` (``q = 1`` decode, ``num_draft_tokens`` verify).
        max_pages: largest number of pages of the real requests of one batch (sum over requests).
        device: device of the buffers.
        mode: ``"decode"`` or ``"verify"`` (TARGET_VERIFY with a custom tree mask).
        num_draft_tokens: ``q`` per request in verify mode.
        pad_page: page id padded requests read.
        max_seq_len: largest ``kv_len`` of one request (default ``max_pages * page_size``).
        num_kv_splits: triton split count under graphs (default: heuristic at ``max_seq_len``).
    """

    def __init__(
        self,
        config: AttentionConfig,
        provider: str,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        device: torch.device | str = "cuda",
        mode: str = "decode",
        num_draft_tokens: int = 1,
        pad_page: int = 0,
        max_seq_len: int | None = None,
        num_kv_splits: int | None = None,
    ):
        if mode not in ("decode", "verify"):
            raise ValueError(f"mode must be 'decode' or 'verify', got {mode!r}")
        if provider == "reference":
            raise UnsupportedFeature("attnplug: provider 'reference' cannot be captured in a CUDA graph")
        self.config, self.mode, self.device = config, mode, torch.device(device)
        self.q = 1 if mode == "decode" else int(num_draft_tokens)
        if max_batch * self.q > max_tokens:
            raise ValueError(f"max_tokens must be >= max_batch * q = {max_batch * self.q}, got {max_tokens}")
        self.max_batch, self.max_tokens, self.max_pages, self.pad_page = max_batch, max_tokens, max_pages, pad_page
        P = config.page_size
        self.max_seq_len = max_seq_len or max_pages * P
        self.provider = get_provider_cls(provider)(config, self.device)
        self.pad_kv_len = FILL_SEQ_LEN + (self.q if mode == "verify" else 0)
        self.pad_pages = -(-self.pad_kv_len // P)
        self.pad_last = self.pad_kv_len - (self.pad_pages - 1) * P
        dev, mb = self.device, max_batch
        i32 = dict(dtype=_I32, device=dev)
        self.qo_indptr = torch.arange(mb + 1, **i32) * self.q  # constant: q tokens per request
        self.kv_indptr = torch.zeros(mb + 1, **i32)
        self.kv_indices = torch.full((max_pages + mb * self.pad_pages,), pad_page, **i32)
        self.kv_last_page_len = torch.zeros(mb, **i32)
        self.kv_lens = torch.zeros(mb, **i32)
        self._pad_indptr = torch.arange(1, mb + 1, **i32) * self.pad_pages  # offsets of padded requests
        self.mask = self.mask_indptr = self.mask_free = None
        if mode == "verify":
            self.max_mask = self.q * (max_pages * P + mb * self.pad_kv_len)
            self.mask = torch.ones(self.max_mask, dtype=torch.uint8, device=dev)
            self.mask_indptr = torch.zeros(mb + 1, dtype=torch.int64, device=dev)
            self.mask_free = torch.zeros(mb, **i32)
        self.plans: dict[int, Plan] = {}
        self._forced = num_kv_splits
        name = self.provider.name
        if name == "triton":
            self.splits = {bs: self._triton_splits(bs) for bs in range(1, mb + 1)}
            n = max(bs * self.q * s for bs, s in self.splits.items()) * config.num_qo_heads
            self._tiles = (torch.zeros(max_tokens, **i32), torch.zeros(max_tokens, **i32))
            self._ws = (torch.empty(n * config.head_dim, dtype=torch.float32, device=dev),
                        torch.empty(n, dtype=torch.float32, device=dev))
        elif name == "fa3":
            if mode == "verify":  # FA3 on the prefix + the Triton kernel on the tree part, LSE-merged
                self.provider.check_tree_config()
                self._tiles = (torch.zeros(max_tokens, **i32), torch.zeros(max_tokens, **i32))
                self._tree_bufs = self.provider.tree_buffers(max_tokens, dev)
            w = -(-self.max_seq_len // P)
            self.block_table = torch.zeros(mb, w, **i32)
            self._bt_idx = torch.zeros(mb, w, dtype=torch.int64, device=dev)
            self._bt_col = torch.arange(w, dtype=torch.int64, device=dev)
        elif name == "flashinfer":
            self._fi_wrappers: dict[int, object] = {}
            if mode == "verify":
                self._fi_mask = torch.zeros(self.max_mask // 8 + mb + 8, dtype=torch.uint8, device=dev)
                self._fi_mask_indptr = torch.zeros(mb + 1, **i32)

    # -- helpers -----------------------------------------------------------------------------------
    def _triton_splits(self, bs: int) -> int:
        """Split count of the ``bs`` graph: forced, or the provider's heuristic at ``max_seq_len``."""
        fake = type("P", (), {})()
        fake.extra = {} if self._forced is None else {"num_kv_splits": self._forced}
        fake.max_kv_len = self.max_seq_len
        return self.provider._splits(fake, bs, 0)

    def _static_views(self, bs: int) -> dict:
        v = dict(qo_indptr=self.qo_indptr[: bs + 1], kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
                 kv_last_page_len=self.kv_last_page_len[:bs], kv_lens=self.kv_lens[:bs])
        if self.mode == "verify":
            v.update(mask=self.mask, mask_indptr=self.mask_indptr[: bs + 1], mask_free=self.mask_free[:bs])
        return v

    def _padded_host(self, batch: BatchMetadata, bs: int) -> dict | None:
        """Host twins of the padded batch (``None`` when the inputs live on the device)."""
        if batch.kv_indptr.device.type != "cpu" or batch.kv_last_page_len.device.type != "cpu":
            return None
        pad, P = bs - batch.batch_size, self.config.page_size
        n = int(batch.kv_indices.numel())
        ind = torch.cat([batch.kv_indptr.to(_I32), n + torch.arange(1, pad + 1, dtype=_I32) * self.pad_pages])
        idx = torch.cat([batch.kv_indices.cpu().to(_I32), torch.full((pad * self.pad_pages,), self.pad_page, dtype=_I32)])
        last = torch.cat([batch.kv_last_page_len.to(_I32), torch.full((pad,), self.pad_last, dtype=_I32)])
        npg = ind[1:] - ind[:-1]
        kv_lens = torch.where(npg > 0, (npg - 1) * P + last, 0).to(_I32)
        h = dict(qo_indptr=torch.arange(bs + 1, dtype=_I32) * self.q, kv_indptr=ind, kv_indices=idx,
                 kv_last_page_len=last, kv_lens=kv_lens, q_lens=torch.full((bs,), self.q, dtype=_I32))
        if self.mode == "verify":
            mi = torch.zeros(bs + 1, dtype=torch.int64)
            torch.cumsum(kv_lens.long() * self.q, 0, out=mi[1:])
            h["mask_indptr"], h["mask_free"] = mi, kv_lens - self.q
            if batch.custom_mask is not None and batch.custom_mask.device.type == "cpu":
                tail = torch.ones(int(mi[-1]) - batch.custom_mask.numel(), dtype=torch.bool)
                h["mask"] = torch.cat([batch.custom_mask.bool(), tail]).to(torch.uint8)
                self._check_prefix_visible(h, bs)
        return h

    def _check_prefix_visible(self, h: dict, bs: int) -> None:
        """The verify graphs' contract, checked where the mask is on the host (capture, CPU): every
        draft token sees the whole committed prefix (``mask_free = kv_len - q``; the kernels skip
        the mask there). A device mask (a replay) is not read back: that would sync."""
        free = _leading_visible_columns(h["mask"], h["mask_indptr"], h["q_lens"], h["kv_lens"])
        hidden = torch.nonzero(free < h["mask_free"])
        if hidden.numel():
            b = int(hidden[0])
            raise UnsupportedFeature(
                f"attnplug: provider '{self.provider.name}' CUDA-graph verify needs every draft token to see the "
                f"whole committed prefix; request {b}'s mask hides prefix column {int(free[b])} of {int(h['mask_free'][b])}")

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
        cfg, q = self.config, self.q
        h = self._padded_host(batch, bs)
        if h is None:
            raise ValueError("prepare_capture needs host metadata (it runs outside the graph)")
        v = self._static_views(bs)
        plan = Plan(
            config=cfg, mode=ForwardMode.DECODE if self.mode == "decode" else ForwardMode.TARGET_VERIFY,
            batch_size=bs, num_tokens=bs * q, max_q_len=q, max_kv_len=self.max_seq_len,
            causal=self.mode == "decode", device=self.device,
            qo_indptr_cpu=h["qo_indptr"], kv_indptr_cpu=h["kv_indptr"], kv_indices_cpu=h["kv_indices"],
            kv_last_page_len_cpu=h["kv_last_page_len"], q_lens_cpu=h["q_lens"], kv_lens_cpu=h["kv_lens"],
            mask_indptr_cpu=h.get("mask_indptr"), mask_free_cpu=h.get("mask_free"), **v,
        )
        self.plans[bs] = plan
        name = self.provider.name
        if name == "triton":
            plan.extra["num_kv_splits"] = self.splits[bs]
            self.provider.plan(plan, tile_buffers=self._tiles, split_workspace=self._ws)
        elif name == "fa3":
            w = cfg.window_left
            plan.extra["fa3_args"] = dict(
                block_table=self.block_table[:bs], cu_seqlens_q=v["qo_indptr"], seqused_k=v["kv_lens"], max_seqlen_q=q,
                max_seqlen_k=self.max_seq_len, causal=True, window=(w, 0) if w >= 0 else (-1, -1),
                softcap=cfg.logits_soft_cap, scale=cfg.scale,
            )
            plan.extra["fa3_tree"] = None
            if self.mode == "verify":  # prefix = the mask-free columns (kv_len - q), the tree part after it
                prefix = v["mask_free"]
                plan.extra["fa3_args"].update(seqused_k=prefix, causal=False, window=(-1, -1))
                plan.extra["fa3_tree"] = self.provider.plan_tree_part(
                    plan, prefix, tile_buffers=self._tiles, buffers={k: b[: bs * q] for k, b in self._tree_bufs.items()})
        elif name == "flashinfer":
            fi, ws, layout = self.provider._fi, self.provider._workspace, cfg.kv_layout
            if self.mode == "decode":
                wr = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, layout, use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=v["kv_indptr"],
                    paged_kv_indices_buffer=self.kv_indices, paged_kv_last_page_len_buffer=v["kv_last_page_len"])
            else:
                wr = fi.BatchPrefillWithPagedKVCacheWrapper(
                    ws, layout, use_cuda_graph=True, qo_indptr_buf=v["qo_indptr"], paged_kv_indptr_buf=v["kv_indptr"],
                    paged_kv_indices_buf=self.kv_indices, paged_kv_last_page_len_buf=v["kv_last_page_len"],
                    custom_mask_buf=self._fi_mask, mask_indptr_buf=self._fi_mask_indptr[: bs + 1], backend="fa2")
            self._fi_wrappers[bs] = wr
            plan.extra["flashinfer_wrapper"] = wr
        self.update(batch, bs)
        return plan

    def update(self, batch: BatchMetadata, bs: int | None = None) -> Plan:
        """Write ``batch`` (``B <= bs`` requests, ``q`` tokens each) into the static buffers of the
        plan captured for ``bs`` (default: the smallest captured ``bs >= B``), padding ``B..bs-1``.

        Only the prefix ``[:bs+1]`` / ``[:bs]`` of the per-request buffers, ``kv_indices[:nnz +
        (bs-B)*pad_pages]`` and (verify) ``mask[:sum q*kv_len]`` are written.
        """
        B = batch.batch_size
        if bs is None:
            fits = [s for s in self.plans if s >= B]
            if not fits:
                raise ValueError(f"no captured batch size >= {B}; captured: {sorted(self.plans)}")
            bs = min(fits)
        plan = self.plans[bs]
        pad, P, q = bs - B, self.config.page_size, self.q
        n = int(batch.kv_indices.numel())
        if pad < 0:
            raise ValueError(f"batch has {B} requests > bs={bs}")
        if n > self.max_pages:
            raise ValueError(f"batch needs {n} pages > max_pages={self.max_pages}")
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
        h = self._padded_host(batch, bs)
        if h is not None:  # keep the host twins current (reference checks, FlashInfer)
            plan.kv_indptr_cpu, plan.kv_indices_cpu = h["kv_indptr"], h["kv_indices"]
            plan.kv_last_page_len_cpu, plan.kv_lens_cpu = h["kv_last_page_len"], h["kv_lens"]
            if self.mode == "verify":
                plan.mask_indptr_cpu, plan.mask_free_cpu = h["mask_indptr"], h["mask_free"]
        name = self.provider.name
        if name == "fa3":  # block table rows from the CSR, on the device
            w = self.block_table.shape[1]
            idx = self._bt_idx[:bs]
            torch.add(self.kv_indptr[:bs, None], self._bt_col[None, :w], out=idx)
            idx.clamp_(max=self.kv_indices.numel() - 1)  # entries past a row's pages: any valid id
            torch.index_select(self.kv_indices, 0, idx.view(-1), out=self.block_table[:bs].view(-1))
        elif name == "flashinfer":
            self._flashinfer_plan(plan, h, bs)
        return plan

    def update_from_block_table(self, seq_lens: torch.Tensor, block_table: torch.Tensor, bs: int,
                                row_ids: torch.Tensor | None = None, entry_tokens: int = 1,
                                host_seq_lens: torch.Tensor | None = None) -> Plan:
        """Replay-time update from the block-table form (vLLM's), in one Triton launch on the device.

        Args:
            seq_lens: ``[n]`` (``n <= bs``) KV length per request, this step's ``q`` tokens included;
                ``<= 0`` (and rows ``n..bs-1``): padded request.
            block_table: ``[rows, W]`` page ids, any strides; request ``b`` reads row ``b`` or ``row_ids[b]``.
            bs: a captured batch size.
            row_ids: optional ``[n]`` table row per request (SGLang's ``req_pool_indices``).
            entry_tokens: ``page_size`` for a token-slot table (SGLang's ``req_to_token``: page ``j`` is
                ``table[row, j * P] // P``), 1 for a page table (vLLM's block table).
            host_seq_lens: ``[n]`` host copy of ``seq_lens``; FlashInfer (decode) needs it: its plan
                reads ``kv_indptr`` / ``kv_last_page_len`` on the host, and gets ``kv_indices`` as the
                device buffer this launch wrote (a device-to-device copy, no sync). The launch then
                reads these host lengths (copied over), so plan and buffers cannot disagree.

        Writes what :meth:`update` writes (verify mode: the causal-chain mask, ``c <= kv_len - q + i``,
        vLLM's linear spec decode; tree masks go through :meth:`update`) plus FA3's block table, with
        no host sync and no allocation; the plan's host twins are left as they were. Each request
        must fit ``max_seq_len``.
        """
        from .kernels.graph_update import graph_batch_from_block_table  # noqa: PLC0415 - triton is optional

        if bs not in self.plans:
            raise ValueError(f"bs={bs} was not captured; captured: {sorted(self.plans)}")
        fi = self.provider.name == "flashinfer"
        if fi and (host_seq_lens is None or self.mode != "decode"):
            raise UnsupportedFeature("attnplug: provider 'flashinfer' plans on the host: update_from_block_table needs "
                                     "host_seq_lens and decode mode (verify goes through update())")
        if fi:  # the launch reads the lengths the host plan reads: device buffers and plan agree
            seq_lens = host_seq_lens.to(self.device, non_blocking=True)
        v = self._static_views(bs)
        verify = self.mode == "verify"
        graph_batch_from_block_table(
            seq_lens, block_table, bs, self.config.page_size, self.pad_page, self.pad_kv_len,
            v["kv_indptr"], self.kv_indices, v["kv_last_page_len"], v["kv_lens"],
            block_table_out=self.block_table if self.provider.name == "fa3" else None, q=self.q,
            mask=self.mask if verify else None, mask_indptr=v.get("mask_indptr"), mask_free=v.get("mask_free"),
            max_batch=self.max_batch, row_ids=row_ids, entry_tokens=entry_tokens,
        )  # fmt: skip
        if fi:
            ind, last = self._host_csr(host_seq_lens, bs)
            self._flashinfer_plan(self.plans[bs], dict(kv_indptr=ind, kv_indices=self.kv_indices[: int(ind[-1])],
                                                       kv_last_page_len=last), bs)  # fmt: skip
        return self.plans[bs]

    def _host_csr(self, seq_lens: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host ``kv_indptr [bs+1]`` / ``kv_last_page_len [bs]`` of the padded batch of ``seq_lens [n]``
        (the same padding as the kernel: ``<= 0`` and rows ``n..bs-1`` are padded requests)."""
        P, n = self.config.page_size, seq_lens.shape[0]
        s = torch.full((bs,), self.pad_kv_len, dtype=_I32)
        host = seq_lens.cpu()
        s[:n] = torch.where(host > 0, host, self.pad_kv_len).to(_I32)
        npg = (s + P - 1) // P
        ind = torch.zeros(bs + 1, dtype=_I32)
        torch.cumsum(npg, 0, dtype=_I32, out=ind[1:])
        return ind, s - (npg - 1) * P

    def _flashinfer_plan(self, plan: Plan, h: dict | None, bs: int) -> None:
        cfg = self.config
        if h is None:
            raise ValueError("provider 'flashinfer' needs host kv_indptr / kv_last_page_len in update()")
        common = dict(pos_encoding_mode="NONE", window_left=cfg.window_left, logits_soft_cap=cfg.logits_soft_cap,
                      q_data_type=cfg.dtype, kv_data_type=cfg.dtype, sm_scale=cfg.scale)
        heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size)
        wr = self._fi_wrappers[bs]
        if self.mode == "decode":
            wr.plan(h["kv_indptr"], h["kv_indices"], h["kv_last_page_len"], *heads, **common)
        else:
            v = self._static_views(bs)
            mask = self.mask[: int(h["mask_indptr"][-1])].view(torch.bool)
            wr.plan(v["qo_indptr"], v["kv_indptr"], self.kv_indices[: h["kv_indices"].numel()], v["kv_last_page_len"],
                    *heads, custom_mask=mask, causal=False, **common)

    def run(self, bs: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor | None = None) -> torch.Tensor:
        """Launch the ``bs`` plan: ``q [bs*q, Hq, D]`` -> ``out [bs*q, Hq, D]``; no host work (capturable)."""
        self.provider.run(self.plans[bs], q, k_cache, v_cache, out, lse)
        return out
