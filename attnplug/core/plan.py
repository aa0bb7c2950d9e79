"""Validation of a batch and the provider-neutral part of a plan (built once per forward).

``make_plan`` is the only place bad input is detected: every ``ValueError`` names the argument and
the value expected. Providers then add their own kernel arguments to the plan; the per-layer
``run`` trusts the plan and does no host work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .config import AttentionConfig
from .metadata import BatchMetadata, ForwardMode


@dataclass(frozen=True)
class PlanOptions:
    """Tuning knobs of one plan: ``PagedAttention.plan(batch, **knobs)``. ``None`` = the provider's
    default. A provider accepts only the knobs in its ``OPTIONS`` (others raise ``ValueError``).

    Attributes:
        num_kv_splits: triton: split-KV chunks per tile (default: from the SM count and ``max_kv_len``).
        block_m, block_n, num_warps, num_stages: triton: tile rows (query rows x GQA heads), keys per
            block, warps, pipeline stages.
        prefill_backend: flashinfer: ``"auto"``, ``"fa2"`` or ``"fa3"`` (prefill template).
        kv_start: triton: ``[B]`` int32 on the device; request ``b`` attends only to keys at positions
            ``>= kv_start[b]`` (the fa3 provider's tree part).
    """

    num_kv_splits: int | None = None
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    prefill_backend: str | None = None
    kv_start: torch.Tensor | None = None

    def set_fields(self) -> set[str]:
        """Names of the knobs that are set (not ``None``)."""
        return {f.name for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def parse(cls, knobs: dict) -> "PlanOptions":
        """Options from keyword arguments; ``ValueError`` naming an unknown knob."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(knobs) - names)
        if unknown:
            raise ValueError(f"attnplug: unknown plan option(s) {unknown}; known: {sorted(names)}")
        return cls(**knobs)


@dataclass
class Plan:
    """Provider-neutral kernel arguments of one forward.

    Device tensors (int32 unless noted) live on ``device``; ``*_cpu`` twins stay on the host for
    providers that plan on the CPU (FlashInfer) and for building work lists.

    Attributes:
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len: as in :class:`BatchMetadata`.
        kv_lens: ``[B]`` KV tokens per request.
        q_lens_cpu, kv_lens_cpu: ``[B]`` host copies.
        mask: ``[sum q_len*kv_len]`` uint8 custom mask or ``None``.
        mask_indptr: ``[B+1]`` int64 offsets into ``mask`` (``None`` without a mask).
        mask_free: ``[B]`` int32, leading KV columns of each request's mask that every query sees
            (``kv_len - q_len`` for a verify tree over a visible prefix); kernels skip mask work there.
        options: the caller's tuning knobs (:class:`PlanOptions`).
        state: the provider's typed per-forward state (its launch arguments), set by ``Provider.plan``.
    """

    config: AttentionConfig
    mode: ForwardMode
    batch_size: int
    num_tokens: int
    max_q_len: int
    max_kv_len: int
    causal: bool
    device: torch.device
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    qo_indptr_cpu: torch.Tensor
    kv_indptr_cpu: torch.Tensor
    kv_indices_cpu: torch.Tensor
    kv_last_page_len_cpu: torch.Tensor
    q_lens_cpu: torch.Tensor
    kv_lens_cpu: torch.Tensor
    mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    mask_indptr_cpu: torch.Tensor | None = None
    mask_free: torch.Tensor | None = None
    mask_free_cpu: torch.Tensor | None = None
    options: PlanOptions = field(default_factory=lambda: PlanOptions())
    state: Any = None


def _check_index_tensor(name: str, t: Any, numel: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
    return t.cpu()


def _check_indptr(name: str, indptr: torch.Tensor, total: int | None) -> None:
    if indptr.numel() == 0 or int(indptr[0]) != 0:
        raise ValueError(f"{name}[0] must be 0")
    if bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if total is not None and int(indptr[-1]) != total:
        raise ValueError(f"{name}[-1] must equal {total}, got {int(indptr[-1])}")


def _leading_visible_columns(
    mask: torch.Tensor, mask_indptr: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor
) -> torch.Tensor:
    """``[B]`` int32: per request, how many leading KV columns of its mask are True in every row."""
    out = torch.zeros(q_lens.numel(), dtype=torch.int32)
    for b, (ql, kl) in enumerate(zip(q_lens.tolist(), kv_lens.tolist())):
        if ql and kl:
            lo = int(mask_indptr[b])
            cols = mask[lo : lo + ql * kl].view(ql, kl).bool().all(0)
            out[b] = int(torch.cumprod(cols.to(torch.int32), 0).sum())
    return out


def make_plan(
    config: AttentionConfig,
    batch: BatchMetadata,
    num_pages: int | None = None,
    device: torch.device | str | None = None,
) -> Plan:
    """Validate ``batch`` against ``config`` and build the provider-neutral plan.

    Args:
        config: static attention configuration.
        batch: the forward's metadata (host or device tensors; host is cheaper).
        num_pages: number of pages in the KV cache; page ids must be in ``[0, num_pages)``.
        device: where kernel arguments live (default: the device of ``batch.kv_indices``).

    Raises:
        ValueError: naming the argument and the expected value.
    """
    if not isinstance(batch.mode, ForwardMode):
        raise ValueError(f"mode must be a ForwardMode, got {batch.mode!r}")
    device = torch.device(device) if device is not None else batch.kv_indices.device
    qo_indptr = _check_index_tensor("qo_indptr", batch.qo_indptr)
    bsz = qo_indptr.numel() - 1
    if bsz < 0:
        raise ValueError("qo_indptr must have at least 1 element (B+1 with B >= 0)")
    kv_indptr = _check_index_tensor("kv_indptr", batch.kv_indptr, bsz + 1)
    kv_indices = _check_index_tensor("kv_indices", batch.kv_indices)
    last = _check_index_tensor("kv_last_page_len", batch.kv_last_page_len, bsz)
    _check_indptr("qo_indptr", qo_indptr, None)
    _check_indptr("kv_indptr", kv_indptr, kv_indices.numel())

    page = config.page_size
    num_req_pages = kv_indptr[1:] - kv_indptr[:-1]
    has_pages = num_req_pages > 0
    if bool(((last < 1) | (last > page))[has_pages].any()):
        raise ValueError(f"kv_last_page_len must be in 1..page_size={page} for requests with pages")
    if bool((last != 0)[~has_pages].any()):
        raise ValueError("kv_last_page_len must be 0 for requests without pages")
    if kv_indices.numel():
        lo, hi = int(kv_indices.min()), int(kv_indices.max())
        if lo < 0 or (num_pages is not None and hi >= num_pages):
            raise ValueError(
                f"kv_indices must be in [0, num_pages={num_pages}), got values in [{lo}, {hi}]"
            )
    kv_lens = torch.where(has_pages, (num_req_pages - 1) * page + last, torch.zeros_like(last))
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    if bool((q_lens > kv_lens).any()):
        b = int(torch.nonzero(q_lens > kv_lens)[0])
        raise ValueError(
            f"request {b}: q_len={int(q_lens[b])} exceeds kv_len={int(kv_lens[b])}; the KV of the new "
            "tokens must be in the cache (kv_len counts prefix + new tokens)"
        )
    if batch.mode == ForwardMode.DECODE and bool((q_lens != 1).any()):
        raise ValueError(f"DECODE needs q_len == 1 for every request, got q_lens={q_lens.tolist()}")

    mask = mask_indptr = mask_indptr_cpu = mask_free = mask_free_cpu = None
    if batch.custom_mask is not None:
        cm = batch.custom_mask
        if not isinstance(cm, torch.Tensor) or cm.dtype not in (torch.bool, torch.uint8) or cm.dim() != 1:
            raise ValueError("custom_mask must be a 1-D torch.bool tensor")
        sizes = (q_lens.to(torch.int64) * kv_lens.to(torch.int64))
        mask_indptr_cpu = torch.zeros(bsz + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=mask_indptr_cpu[1:])
        expected = int(mask_indptr_cpu[-1])
        if cm.numel() != expected:
            raise ValueError(
                f"custom_mask must have sum(q_len*kv_len)={expected} elements, got {cm.numel()}"
            )
        mask = cm.to(device=device, dtype=torch.uint8)
        mask_indptr = mask_indptr_cpu.to(device)
        mask_free_cpu = _leading_visible_columns(cm.cpu(), mask_indptr_cpu, q_lens, kv_lens)
        mask_free = mask_free_cpu.to(device)
    elif batch.mode == ForwardMode.TARGET_VERIFY and not batch.causal:
        raise ValueError("TARGET_VERIFY without custom_mask must be causal (a chain of draft tokens)")

    to_dev = lambda t: t.to(device=device, non_blocking=True)  # noqa: E731
    return Plan(
        config=config,
        mode=batch.mode,
        batch_size=bsz,
        num_tokens=int(qo_indptr[-1]),
        max_q_len=int(q_lens.max()) if bsz else 0,
        max_kv_len=int(kv_lens.max()) if bsz else 0,
        causal=batch.causal if mask is None else False,
        device=device,
        qo_indptr=to_dev(qo_indptr),
        kv_indptr=to_dev(kv_indptr),
        kv_indices=to_dev(kv_indices),
        kv_last_page_len=to_dev(last),
        kv_lens=to_dev(kv_lens.to(torch.int32)),
        qo_indptr_cpu=qo_indptr,
        kv_indptr_cpu=kv_indptr,
        kv_indices_cpu=kv_indices,
        kv_last_page_len_cpu=last,
        q_lens_cpu=q_lens,
        kv_lens_cpu=kv_lens.to(torch.int32),
        mask=mask,
        mask_indptr=mask_indptr,
        mask_indptr_cpu=mask_indptr_cpu,
        mask_free=mask_free,
        mask_free_cpu=mask_free_cpu,
    )


def check_run_inputs(
    config: AttentionConfig, plan: Plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Check q / cache tensors against the config (call once at setup, not per layer).

    Raises:
        ValueError: naming the argument and the expected value.
    """
    exp_q = (plan.num_tokens, config.num_qo_heads, config.head_dim)
    if tuple(q.shape) != exp_q:
        raise ValueError(f"q must have shape [num_tokens, num_qo_heads, head_dim]={list(exp_q)}, got {list(q.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != config.dtype:
            raise ValueError(f"{name} must have dtype {config.dtype}, got {t.dtype}")
    exp_c = config.kv_cache_shape(k_cache.shape[0])
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(t.shape) != exp_c:
            raise ValueError(
                f"{name} must have shape {list(exp_c)} ({config.kv_layout} layout), got {list(t.shape)}"
            )
    if plan.kv_indices_cpu.numel() and int(plan.kv_indices_cpu.max()) >= k_cache.shape[0]:
        raise ValueError(f"kv_indices must be < num_pages={k_cache.shape[0]}")
