"""EAGLE-style speculative decoding metadata: multi-step draft decode and the tree-verify mask.

Draft (SGLang's EAGLE with ``topk`` / ``num_steps``, cf. its ``generate_draft_decode_kv_indices``):
``B`` requests, request ``b`` has a committed prefix of ``seq_len[b]`` tokens in the paged cache.
At draft step ``i`` (``0..num_steps-1``) there are ``R = B*topk`` query rows, row ``r = b*topk + j``
(request ``b``, branch ``j``); it attends to the prefix of ``b`` plus the draft tokens of its own
branch from steps ``0..i``, whose KV the engine wrote at token slots ``draft_slots[b, j, 0..i]``.

Representation: draft tokens do not lie in the request's page sequence, so every row is a virtual
request of a **token-granular** CSR (``page_size = 1``): its KV indices are token slots
``page * P + offset`` (the prefix pages expanded, then the draft slots). The kernels then read a
token view of the cache, :func:`token_view` (``[num_pages*P, 1, Hkv, D]``, free for NHD; HND only
with ``P == 1``). Cost: ``kv_indices`` holds ``topk * sum(seq_len)`` entries per step instead of
``sum(seq_len) / P`` (SGLang's triton/FA3 backends do the same at page size 1).

:class:`MultiStepDraftPlanner` builds the metadata of all steps on the host at once, copies it to
the device in **one** host->device copy into preallocated shared buffers, and returns one core
:class:`~attnplug.core.plan.Plan` per step. Under CUDA graphs use one
:class:`~attnplug.core.cuda_graph.GraphState` (decode mode, :func:`token_config`) per step, fed with
:meth:`MultiStepDraftPlanner.step_batches`.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import AttentionConfig, UnsupportedFeature
from .metadata import BatchMetadata, ForwardMode
from .plan import Plan, make_plan
from .providers import Provider, provider_instance

_I32 = torch.int32


def token_config(config: AttentionConfig) -> AttentionConfig:
    """The same config at token granularity (``page_size = 1``)."""
    return dataclasses.replace(config, page_size=1)


def token_view(cache: torch.Tensor, config: AttentionConfig) -> torch.Tensor:
    """View a paged cache as ``page_size = 1`` pages: token slot ``page*P + off`` becomes page id.

    Args:
        cache: ``[num_pages, P, Hkv, D]`` (NHD) or ``[num_pages, Hkv, P, D]`` (HND, only ``P == 1``).

    Returns:
        ``[num_pages*P, 1, Hkv, D]`` (NHD) / ``[num_pages, Hkv, 1, D]`` (HND); no copy.

    Raises:
        UnsupportedFeature: HND with ``P > 1``, or an NHD cache whose page stride is not ``P`` tokens.
    """
    P = config.page_size
    if config.kv_layout == "HND":
        if P != 1:
            raise UnsupportedFeature("attnplug: multi-step draft on an HND cache needs page_size 1 (token slots)")
        return cache
    n, _, h, d = cache.shape
    if n > 1 and cache.stride(0) != P * cache.stride(1):
        raise UnsupportedFeature("attnplug: multi-step draft needs an NHD cache whose pages are P consecutive tokens")
    return cache.as_strided((n * P, 1, h, d), (cache.stride(1), cache.stride(1), cache.stride(2), cache.stride(3)))


def prefix_token_slots(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expand a paged CSR (host int32) to token slots.

    Returns:
        ``seq_lens [B]``, ``tok_indptr [B+1]`` (int64), ``slots [sum(seq_lens)]`` int64 with
        ``slots[tok_indptr[b] + t] = kv_indices[kv_indptr[b] + t // P] * P + t % P``.
    """
    P = page_size
    npages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    seq = torch.where(npages > 0, (npages - 1) * P + kv_last_page_len.long(), 0)
    tok_indptr = torch.zeros(seq.numel() + 1, dtype=torch.int64)
    torch.cumsum(seq, 0, out=tok_indptr[1:])
    total = int(tok_indptr[-1])
    req = torch.repeat_interleave(torch.arange(seq.numel()), seq, output_size=total)
    t = torch.arange(total) - tok_indptr[req]
    slots = kv_indices.long()[kv_indptr.long()[req] + t // P] * P + t % P
    return seq, tok_indptr, slots


def draft_step_metadata(
    seq_lens: torch.Tensor, tok_indptr: torch.Tensor, slots: torch.Tensor, draft_slots: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-granular CSR of draft step ``step`` (host, vectorized).

    Args:
        seq_lens, tok_indptr, slots: from :func:`prefix_token_slots`.
        draft_slots: ``[B, topk, num_steps]`` token slots of the draft tokens.

    Returns:
        ``kv_indptr [B*topk+1]`` int32, ``kv_indices`` int32: row ``b*topk+j`` = prefix slots of
        ``b`` then ``draft_slots[b, j, :step+1]``.
    """
    B, K, _ = draft_slots.shape
    seq = seq_lens.long().repeat_interleave(K)  # [R]
    kv_len = seq + step + 1
    indptr = torch.zeros(B * K + 1, dtype=torch.int64)
    torch.cumsum(kv_len, 0, out=indptr[1:])
    total = int(indptr[-1])
    row = torch.repeat_interleave(torch.arange(B * K), kv_len, output_size=total)
    t = torch.arange(total) - indptr[row]
    b = row // K
    pre = t < seq[row]
    src = torch.cat([slots, slots.new_zeros(1)])  # never empty
    pre_val = src[torch.where(pre, tok_indptr[b] + t, slots.numel())]
    dr_val = draft_slots.reshape(B * K, -1).long()[row, (t - seq[row]).clamp(min=0)]
    return indptr.to(_I32), torch.where(pre, pre_val, dr_val).to(_I32)


def step_batches_from_token_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    draft_columns: torch.Tensor,
    num_steps: int,
) -> list[BatchMetadata]:
    """Every draft step's metadata read from a token-slot table (SGLang's ``req_to_token``), without
    reading the table back to the host (the CUDA-graph path of a multi-step draft).

    Args:
        req_to_token: ``[rows, max_ctx]`` token slots (``page * P + offset``), any device.
        req_pool_indices: ``[B]`` row of each request.
        seq_lens: ``[B]`` host committed prefix lengths.
        draft_columns: ``[B, topk, >= num_steps]`` host, the table column holding each draft token's slot.
        num_steps: attention steps.

    Returns:
        ``num_steps`` DECODE :class:`BatchMetadata` at token granularity (``page_size = 1``) over
        ``B*topk`` rows, row ``b*topk + j`` = prefix slots of ``b`` then ``draft_columns[b, j, :i+1]``:
        ``qo_indptr`` / ``kv_indptr`` / ``kv_last_page_len`` on the host, ``kv_indices`` gathered on
        the table's device (host index arrays, one gather per step).
    """
    seq = seq_lens.cpu().long()
    B, K = draft_columns.shape[:2]
    tok_indptr = torch.zeros(B + 1, dtype=torch.int64)
    torch.cumsum(seq, 0, out=tok_indptr[1:])
    n = int(tok_indptr[-1])
    req_of = torch.repeat_interleave(torch.arange(B), seq, output_size=n)  # request of each prefix token
    col_of = torch.arange(n) - tok_indptr[req_of]  # its column in the table
    reqs = torch.arange(B)[:, None, None].expand_as(draft_columns)
    dev, nb = req_to_token.device, dict(non_blocking=True)
    rows = req_pool_indices.to(dev, **nb).long()
    R = B * K
    out = []
    for i in range(num_steps):
        indptr, b_idx = draft_step_metadata(seq, tok_indptr, req_of, reqs, i)  # request of each entry
        _, c_idx = draft_step_metadata(seq, tok_indptr, col_of, draft_columns, i)  # its table column
        kv_indices = req_to_token[rows[b_idx.to(dev, **nb).long()], c_idx.to(dev, **nb).long()].to(_I32)
        out.append(
            BatchMetadata(
                ForwardMode.DECODE, torch.arange(R + 1, dtype=_I32), indptr, kv_indices, torch.ones(R, dtype=_I32)
            )
        )
    return out


class MultiStepDraftPlanner:
    """Plans every draft step of an EAGLE draft at once (one host->device copy, shared buffers).

    Args:
        config: attention config of the draft layers (``page_size`` = the cache's ``P``).
        topk, num_steps: branches per request and draft steps (``num_steps`` plans per call).
        max_batch: largest ``B``.
        provider: a registered provider name, class or instance (of ``token_config(config)``).
        device: device of q and the cache.
        max_prefix_tokens: capacity, largest ``sum(seq_len)`` of a batch.
        num_kv_splits: force the split count of providers that split (default: theirs, per step).

    The plans returned by :meth:`plan` stay valid until the next :meth:`plan` (they view the shared
    buffers). ``run(step, ...)`` takes the cache in its paged shape (the token view is internal).
    """

    def __init__(
        self,
        config: AttentionConfig,
        topk: int,
        num_steps: int,
        max_batch: int,
        provider: str | type[Provider] | Provider = "triton",
        device: torch.device | str = "cuda",
        max_prefix_tokens: int = 1 << 16,
        num_kv_splits: int | None = None,
    ):
        if topk < 1 or num_steps < 1 or max_batch < 1:
            raise ValueError(f"topk, num_steps, max_batch must be >= 1, got {topk}, {num_steps}, {max_batch}")
        self.config, self.tok_config = config, token_config(config)
        self.topk, self.num_steps, self.max_batch = topk, num_steps, max_batch
        self.device = torch.device(device)
        self.num_kv_splits = num_kv_splits
        if config.kv_layout == "HND" and config.page_size > 1:
            raise UnsupportedFeature("attnplug: multi-step draft on an HND cache needs page_size 1 (token slots)")
        p0 = provider_instance(provider, self.tok_config, self.device).fork()
        self.providers = p0.step_providers(num_steps)  # plans of every step stay valid at once
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=self.device) if config.kv_quantized else None
        R, S = max_batch * topk, num_steps
        self._head_cap = 2 * R + 1 + S * (2 * R + 1)
        self._idx_cap = S * topk * max_prefix_tokens + R * S * (S + 1) // 2
        self._buf = torch.zeros(self._head_cap + self._idx_cap, dtype=_I32, device=self.device)
        self._pin = self.device.type == "cuda"
        # the providers' own static memory (e.g. triton's tiles and split partials), shared by the steps
        self._static = p0.static_buffers(
            max_rows=R, max_tokens=R, max_kv_len=max_prefix_tokens + S, q=1, num_kv_splits=num_kv_splits
        )
        self.plans: list[Plan] = []

    @property
    def provider_name(self) -> str:
        return self.providers[0].name

    def step_batches(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        draft_slots: torch.Tensor,
    ) -> list[BatchMetadata]:
        """Host :class:`BatchMetadata` (DECODE, ``page_size = 1``) of every step; see :meth:`plan`."""
        seq, tok_indptr, slots = prefix_token_slots(
            kv_indptr.cpu(), kv_indices.cpu(), kv_last_page_len.cpu(), self.config.page_size
        )
        R = seq.numel() * self.topk
        out = []
        for i in range(self.num_steps):
            indptr, idx = draft_step_metadata(seq, tok_indptr, slots, draft_slots.cpu(), i)
            out.append(
                BatchMetadata(
                    ForwardMode.DECODE, torch.arange(R + 1, dtype=_I32), indptr, idx, torch.ones(R, dtype=_I32)
                )
            )
        return out

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        draft_slots: torch.Tensor,
        num_pages: int | None = None,
    ) -> list[Plan]:
        """Plan all draft steps.

        Args:
            kv_indptr, kv_indices, kv_last_page_len: paged CSR of the committed prefixes (host int32
                preferred; ``B = len(kv_last_page_len)``), page size ``config.page_size``.
            draft_slots: ``[B, topk, num_steps]`` token slots (``page*P + off``) of the draft tokens.
            num_pages: pages in the cache (bounds check).

        Returns:
            ``num_steps`` plans; step ``i``: DECODE over ``B*topk`` rows, ``kv_len = seq_len + i + 1``.

        Raises:
            ValueError: bad input or capacity exceeded (names the argument).
        """
        cfg, K, S, P = self.config, self.topk, self.num_steps, self.config.page_size
        B = int(kv_last_page_len.numel())
        if not 0 <= B <= self.max_batch:
            raise ValueError(f"batch size must be in 0..max_batch={self.max_batch}, got {B}")
        if not isinstance(draft_slots, torch.Tensor) or tuple(draft_slots.shape) != (B, K, S):
            raise ValueError(f"draft_slots must have shape [B, topk, num_steps]={[B, K, S]}")
        # validate the prefix CSR as a batch with no queries (host)
        pre = make_plan(
            cfg,
            BatchMetadata(
                ForwardMode.EXTEND,
                torch.zeros(B + 1, dtype=_I32),
                kv_indptr.cpu(),
                kv_indices.cpu(),
                kv_last_page_len.cpu(),
            ),
            num_pages,
            device="cpu",
        )
        ds = draft_slots.cpu().long()
        if ds.numel() and (int(ds.min()) < 0 or (num_pages is not None and int(ds.max()) >= num_pages * P)):
            raise ValueError(
                "draft_slots must be token slots in "
                f"[0, num_pages*page_size={None if num_pages is None else num_pages * P})"
            )
        seq, tok_indptr, slots = prefix_token_slots(pre.kv_indptr_cpu, pre.kv_indices_cpu, pre.kv_last_page_len_cpu, P)
        R = B * K
        steps = [draft_step_metadata(seq, tok_indptr, slots, ds, i) for i in range(S)]
        n_idx = sum(int(ind.numel()) for _, ind in steps)
        if n_idx > self._idx_cap:
            raise ValueError(f"draft KV indices need {n_idx} slots > capacity {self._idx_cap}: raise max_prefix_tokens")
        # packed host layout: qo_indptr | last | per step (kv_indptr | kv_lens) | kv_indices of all steps
        parts = [torch.arange(R + 1, dtype=_I32), torch.ones(R, dtype=_I32)]
        for i, (indptr, _) in enumerate(steps):
            parts += [indptr, (seq.repeat_interleave(K) + i + 1).to(_I32)]
        parts += [ind for _, ind in steps]
        host = torch.cat(parts)
        if self._pin:
            host = host.pin_memory()
        dev = self._buf[: host.numel()]
        dev.copy_(host, non_blocking=True)  # the one host->device copy

        off = 0

        def take(n):
            nonlocal off
            off += n
            return dev[off - n : off], host[off - n : off]

        qo, qo_h = take(R + 1)
        last, last_h = take(R)
        heads = [(take(R + 1), take(R)) for _ in range(S)]
        self.plans = []
        max_seq = int(seq.max()) if B else 0
        for i in range(S):
            (ind_d, ind_h), (len_d, len_h) = heads[i]
            idx_d, idx_h = take(steps[i][1].numel())
            plan = Plan(
                config=self.tok_config,
                mode=ForwardMode.DECODE,
                batch_size=R,
                num_tokens=R,
                max_q_len=1 if R else 0,
                max_kv_len=max_seq + i + 1 if R else 0,
                causal=True,
                device=self.device,
                qo_indptr=qo,
                kv_indptr=ind_d,
                kv_indices=idx_d,
                kv_last_page_len=last,
                kv_lens=len_d,
                qo_indptr_cpu=qo_h,
                kv_indptr_cpu=ind_h,
                kv_indices_cpu=idx_h,
                kv_last_page_len_cpu=last_h,
                q_lens_cpu=torch.ones(R, dtype=_I32),
                kv_lens_cpu=len_h,
            )
            if self.num_kv_splits is not None:
                plan.options = self.providers[i].pinned_options({}, self.num_kv_splits)
            self.providers[i].plan(plan, static=self._static)
            self.plans.append(plan)
        return self.plans

    def run(
        self,
        step: int,
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
        """Attention of draft step ``step``: ``q [B*topk, Hq, D]`` (row ``b*topk+j``) over the paged
        caches (``config`` shape) -> ``out [B*topk, Hq, D]`` (+ natural-log ``lse [B*topk, Hq]``).
        fp8 KV: the layer's scales, ``sinks [Hq]``: the layer's sink logits, as in ``PagedAttention.run``."""
        scales = self.config.scale_kwargs(self._unit_scale, k_scale, v_scale, q_scale, host_scales)
        scales.update(self.config.sink_kwargs(sinks))
        self.providers[step].run(
            self.plans[step], q, token_view(k_cache, self.config), token_view(v_cache, self.config), out, lse, **scales
        )
        return out


def build_tree_verify_mask(parents: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """TARGET_VERIFY custom mask of a draft tree (pure torch, any device).

    Args:
        parents: ``[B, n]`` int, ``parents[b, i]`` is the draft token that token ``i`` extends
            (``< i``), or ``-1`` for a child of the last committed token (a root).
        prefix_lens: ``[B]`` committed tokens per request (KV of request ``b`` = prefix then the
            ``n`` draft tokens, so ``kv_len = prefix_lens[b] + n``).

    Returns:
        flat bool ``[sum_b n * (prefix_lens[b] + n)]``; request ``b``'s block is row-major
        ``[n, prefix+n]``: all prefix columns True, draft column ``c`` True iff ``c`` is ``i`` or an
        ancestor of ``i``.
    """
    B, n = parents.shape
    dev = parents.device
    par = parents.long()
    if bool(((par >= torch.arange(n, device=dev)) | (par < -1)).any()):
        raise ValueError("parents[b, i] must be -1 or in [0, i)")
    anc = torch.zeros(B, n, n, dtype=torch.bool, device=dev)
    eye = torch.eye(n, dtype=torch.bool, device=dev)
    for i in range(n):  # parents come first: row i = own bit | parent's row
        p = par[:, i]
        inherit = anc[torch.arange(B, device=dev), p.clamp(min=0)] & (p >= 0)[:, None]
        anc[:, i] = eye[i] | inherit
    blocks = []
    for b, pl in enumerate(prefix_lens.tolist()):
        blocks.append(torch.cat([torch.ones(n, int(pl), dtype=torch.bool, device=dev), anc[b]], 1).flatten())
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool, device=dev)
