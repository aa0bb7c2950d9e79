"""Validation of a batch and the provider-neutral part of a plan (built once per forward).

``make_plan`` is the only place bad input is detected: every ``ValueError`` names the argument and
the value expected. Providers then add their own kernel arguments to the plan; the per-layer
``run`` trusts the plan and does no host work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .config import AttentionConfig
from .metadata import BatchMetadata, ForwardMode
from .staging import to_device

if TYPE_CHECKING:
    from .cascade import CascadePlan


class ProviderState:
    """Base of a provider's per-forward state (``Plan.state``: its launch arguments, set by ``Provider.plan``)."""


class ProviderStatic:
    """Base of a provider's static memory (``Provider.static_buffers``, handed back to ``Provider.plan``)."""


@dataclass(frozen=True)
class PlanOptions:
    """Base of the tuning knobs of one plan: ``PagedAttention.plan(batch, **knobs)``. It has no knobs;
    each provider that takes some declares a subclass in its module (its ``Provider.Options``, e.g.
    ``TritonOptions``), whose fields are the knobs (``None`` = the provider's default).
    ``Plan.options`` holds the provider's type, or this base (no knobs) where nobody set any.
    """

    @classmethod
    def parse(cls, knobs: dict, provider: str | None = None) -> PlanOptions:
        """Options of this type from keyword arguments. No knobs: one shared instance per type (frozen;
        nothing allocated). ``ValueError`` naming attnplug, ``provider`` and the knobs this type reads
        for a knob it does not read."""
        if not knobs:
            return cls.none()
        names = cls.knob_names()
        unknown = sorted(knobs.keys() - names)
        if unknown:
            who = f"provider '{provider}'" if provider is not None else cls.__name__
            raise ValueError(
                f"attnplug: {who} has no plan option(s) {unknown}; it reads {sorted(names) or 'none'} ({cls.__name__})"
            )
        return cls(**knobs)

    @classmethod
    def none(cls) -> PlanOptions:
        """The shared instance of this type with no knob set."""
        empty = _NO_KNOBS.get(cls)
        if empty is None:
            empty = _NO_KNOBS[cls] = cls()
        return empty

    @classmethod
    def knob_names(cls) -> frozenset[str]:
        """The knobs this type reads (its field names)."""
        names = _KNOB_NAMES.get(cls)
        if names is None:
            names = _KNOB_NAMES[cls] = frozenset(f.name for f in fields(cls))
        return names

    @classmethod
    def of(cls, options: PlanOptions) -> PlanOptions:
        """``options`` as this type, for the provider that reads it: itself, or :meth:`none` for the
        knob-less base (a plan nobody set knobs on). ``TypeError`` for another provider's options."""
        if isinstance(options, cls):
            return options
        if type(options) is PlanOptions:
            return cls.none()
        raise TypeError(f"attnplug: plan options {type(options).__name__} given where {cls.__name__} are read")


_NO_KNOBS: dict[type, PlanOptions] = {}
_KNOB_NAMES: dict[type, frozenset[str]] = {}
_NO_OPTIONS = PlanOptions.none()


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
        options: the caller's tuning knobs (the provider's :class:`PlanOptions` subclass, or the
            knob-less base).
        state: the provider's typed per-forward state (its launch arguments), set by ``Provider.plan``.
        cascade: the forward's shared-prefix split (:class:`~attnplug.core.cascade.CascadePlan`), whose
            suffix and prefix plans the provider planned instead of this one; ``None`` otherwise.
        max_page_id: the largest page id in ``kv_indices`` (-1 without pages): ``PagedAttention.run``
            refuses a cache with fewer pages, so an unchecked ``num_pages`` cannot read out of bounds.
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
    options: PlanOptions = _NO_OPTIONS
    state: ProviderState | None = None
    cascade: CascadePlan | None = None
    max_page_id: int = -1

    def replace(self, **changes: Any) -> Plan:
        """A shallow copy with ``changes`` applied (``dataclasses.replace`` without re-running
        ``__init__``: a fifth of its host time). Raises ``TypeError`` for a name that is no field."""
        if not changes.keys() <= _PLAN_FIELDS:
            raise TypeError(f"Plan has no field {sorted(changes.keys() - _PLAN_FIELDS)[0]!r}")
        new = object.__new__(Plan)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_PLAN_FIELDS = frozenset(f.name for f in fields(Plan))
_I32_MAX = 2**31 - 1
# small-vector idioms: argmin/argmax and count_nonzero cost a fraction of a ufunc reduction (min/max/any)
_nnz = np.count_nonzero
_ALL_TRUE_WORD = np.uint64(0x0101010101010101)  # eight bytes of a bool array, all True


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are one device (an index of ``None`` means the current one of that type)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    dt = t.device
    if dt.type != "cpu" and not _same_device(dt, device):
        raise ValueError(f"{name} must be on the host (cpu) or on the plan's device {device}, got {dt}")


def _host_index(
    name: str, t: Any, device: torch.device, numel: int | None = None, max_numel: int | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """Check one int32 index tensor; returns its contiguous host copy (the input itself when it is a
    contiguous host tensor) and a numpy view of that copy. ``max_numel`` is checked before any copy."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if numel is not None and t.shape[0] != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.shape[0]}")
    if max_numel is not None and t.shape[0] > max_numel:
        raise ValueError(
            f"{name}: {t.shape[0]} pages exceed int32 token counts (at most {max_numel} pages of this size)"
        )
    if not t.is_cpu:
        _check_device(name, t, device)
        t = t.cpu()
    t = t.contiguous()  # kernels index the device twin as a flat array
    return t, t.numpy()


def _check_indptr(name: str, indptr: np.ndarray, diffs: np.ndarray, total: int | None) -> None:
    if indptr.shape[0] == 0 or indptr[0] != 0:
        raise ValueError(f"{name}[0] must be 0")
    # int32 differences can wrap: with every value in [0, indptr[-1]] they cannot
    u = indptr.view(np.uint32)
    if diffs.shape[0] and (diffs[diffs.argmin()] < 0 or u[u.argmax()] > indptr[-1]):
        raise ValueError(f"{name} must be non-decreasing from 0, got {_short(indptr)}")
    if total is not None and indptr[-1] != total:
        raise ValueError(f"{name}[-1] must equal {total}, got {int(indptr[-1])}")


def _short(a: np.ndarray, n: int = 8) -> str:
    """``a`` for an error message: the first ``n`` values, then how many more."""
    head = a[:n].tolist()
    return f"{head}{f' ... ({a.shape[0] - n} more)' if a.shape[0] > n else ''}"


def _hidden_np(mask: np.ndarray) -> np.ndarray:
    """``[h]`` int64 positions of the hidden (False) entries of the flat bool ``mask``, ascending.

    Vectorized: finds the words of eight bytes that hold a hidden entry (a verify tree has few of
    them), then the hidden bytes inside those words; the bytes past the last whole word directly."""
    n = mask.shape[0]
    n8 = n & ~7
    words = mask[:n8].view(np.uint64)
    start = (words != _ALL_TRUE_WORD).nonzero()[0]  # [k] words with a hidden byte
    z = (words[start].view(np.uint8) == 0).nonzero()[0]  # hidden bytes: word z >> 3, byte z & 7
    hidden = (start << 3)[z >> 3] + (z & 7)
    if n8 < n:
        hidden = np.concatenate((hidden, (~mask[n8:]).nonzero()[0] + n8))
    return hidden


def _mask_free_np(mask: np.ndarray, mask_indptr: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """``[B]`` int32: per request, the leading KV columns of its mask that are True in every row.

    ``mask``: ``[sum q_len*kv_len]`` flat contiguous bool (request ``b``'s rows at ``mask_indptr[b]``,
    each ``kv_lens[b]`` long); ``mask_indptr``: ``[B+1]`` int64; ``q_lens``, ``kv_lens``: ``[B]`` ints.
    The smallest hidden column per request (of :func:`_hidden_np`) comes from ``np.minimum.at``."""
    hidden = _hidden_np(mask)
    free = kv_lens.astype(np.int64)
    if hidden.shape[0]:
        req = mask_indptr[1:].searchsorted(hidden, "right")
        np.minimum.at(free, req, (hidden - mask_indptr[req]) % free[req])
    if _nnz(q_lens) < q_lens.shape[0]:
        free[q_lens == 0] = 0
    return free.astype(np.int32)


def _leading_visible_columns(
    mask: torch.Tensor, mask_indptr: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor
) -> torch.Tensor:
    """``[B]`` int32: per request, how many leading KV columns of its mask are True in every row
    (host tensors; ``mask`` bool or uint8, nonzero = visible)."""
    m = mask.contiguous().numpy()
    m = m if m.dtype == np.bool_ else m != 0
    return torch.from_numpy(_mask_free_np(m, mask_indptr.numpy().astype(np.int64), q_lens.numpy(), kv_lens.numpy()))


def _check_num_pages(num_pages: Any) -> int | None:
    if num_pages is None:
        return None
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 0:
        raise ValueError(f"num_pages must be None or an int >= 0, got {num_pages!r}")
    return int(num_pages)


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
        num_pages: number of pages in the KV cache; page ids must be in ``[0, num_pages)``
            (``None``: only ``>= 0`` is checked here; ``PagedAttention.run`` checks the cache's size).
        device: where kernel arguments live (default: the device of ``batch.kv_indices``).

    Raises:
        ValueError: naming the argument and the expected value.

    Host cost: one pass of numpy over the host int32 arrays (no per-request Python, no torch op
    with a fixed overhead); ``benchmarks/probes/plan_cost.py`` measures it.
    """
    if not isinstance(batch, BatchMetadata):
        raise ValueError(f"batch must be a BatchMetadata, got {type(batch).__name__}")
    if not isinstance(batch.mode, ForwardMode):
        raise ValueError(f"mode must be a ForwardMode, got {batch.mode!r}")
    if not isinstance(batch.causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {batch.causal!r}")
    num_pages = _check_num_pages(num_pages)
    if device is None:  # the device of kv_indices
        if not isinstance(batch.kv_indices, torch.Tensor):
            raise ValueError(
                f"kv_indices must be a torch.Tensor of dtype torch.int32, got {type(batch.kv_indices).__name__}"
            )
        device = batch.kv_indices.device
        if device.type == "meta":
            raise ValueError("kv_indices must be on a real device (it sets the plan's device), got meta")
    else:
        device = _plan_device(device)
    on_host = device.type == "cpu"
    if not on_host and device.type == "meta":
        raise ValueError(f"device must be a real device, got {device}")
    qo_t, qo = _host_index("qo_indptr", batch.qo_indptr, device)
    bsz = qo.shape[0] - 1
    if bsz < 0:
        raise ValueError("qo_indptr must have at least 1 element (B+1 with B >= 0)")
    kvp_t, kvp = _host_index("kv_indptr", batch.kv_indptr, device, bsz + 1)
    idx_t, idx = _host_index("kv_indices", batch.kv_indices, device, max_numel=_I32_MAX // config.page_size)
    last_t, last = _host_index("kv_last_page_len", batch.kv_last_page_len, device, bsz)
    q_lens = qo[1:] - qo[:-1]
    _check_indptr("qo_indptr", qo, q_lens, None)
    npages = kvp[1:] - kvp[:-1]
    nnz = idx.shape[0]
    _check_indptr("kv_indptr", kvp, npages, nnz)

    page = config.page_size  # nnz * page <= int32 max: checked by _host_index before any copy
    # every request with pages has kv_last_page_len in 1..page_size, every other one 0:
    # lo = 1 with pages, 0 without; last - lo must lie in [0, lo * (page_size - 1)]
    lo_last = np.minimum(npages, 1)
    if bsz and _nnz((last - lo_last).view(np.uint32) > lo_last * (page - 1)):  # a negative reads as >= 2**31
        bad = (npages > 0) & ((last < 1) | (last > page))
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(
                f"kv_last_page_len must be in 1..page_size={page} for requests with pages, "
                f"got {int(last[b])} for request {b}"
            )
        b = int(np.argmax((npages == 0) & (last != 0)))
        raise ValueError(f"kv_last_page_len must be 0 for requests without pages, got {int(last[b])} for request {b}")
    max_page_id = -1
    if nnz:  # one pass: a negative id read as uint32 is >= 2**31, above every valid id
        ids = idx.view(np.uint32)
        max_page_id = int(ids[ids.argmax()])
        if max_page_id > _I32_MAX or (num_pages is not None and max_page_id >= num_pages):
            raise ValueError(
                f"kv_indices must be in [0, num_pages={num_pages}), got values in [{int(idx.min())}, {int(idx.max())}]"
            )
    kv_lens = (npages - lo_last) * page + last  # (pages - 1) * P + last, 0 without pages; int32: nnz * P fits
    if bsz:
        over = q_lens > kv_lens
        if _nnz(over):
            b = int(np.argmax(over))
            raise ValueError(
                f"qo_indptr: request {b}'s q_len={int(q_lens[b])} exceeds kv_len={int(kv_lens[b])} (from kv_indptr / "
                "kv_last_page_len); the KV of the new tokens must be in the cache (kv_len counts prefix + new tokens)"
            )
        max_q_len, max_kv_len = int(q_lens[q_lens.argmax()]), int(kv_lens[kv_lens.argmax()])
    else:
        max_q_len = max_kv_len = 0
    if batch.mode is ForwardMode.DECODE and bsz and (max_q_len != 1 or q_lens[q_lens.argmin()] != 1):
        raise ValueError(f"DECODE needs q_len == 1 for every request (qo_indptr), got q_lens={_short(q_lens, 16)}")

    q_lens_t, kv_lens_t = torch.from_numpy(q_lens), torch.from_numpy(kv_lens)
    mask = mask_indptr = mask_indptr_cpu = mask_free = mask_free_cpu = None
    staged_mask: tuple = ()
    if batch.custom_mask is not None:
        cm = batch.custom_mask
        if not isinstance(cm, torch.Tensor) or cm.dtype not in (torch.bool, torch.uint8) or cm.dim() != 1:
            got = f"{cm.dtype} shape {tuple(cm.shape)}" if isinstance(cm, torch.Tensor) else type(cm).__name__
            raise ValueError(f"custom_mask must be a 1-D torch.bool (or uint8) tensor, got {got}")
        _check_device("custom_mask", cm, device)
        mi = np.zeros(bsz + 1, dtype=np.int64)
        np.cumsum(q_lens.astype(np.int64) * kv_lens, out=mi[1:])
        expected = int(mi[-1])
        if cm.shape[0] != expected:
            raise ValueError(f"custom_mask must have sum(q_len*kv_len)={expected} elements, got {cm.shape[0]}")
        m = cm.cpu().contiguous().numpy()
        mb = m if m.dtype == np.bool_ else m != 0
        mask_free_np = _mask_free_np(mb, mi, q_lens, kv_lens)
        mask_indptr_cpu, mask_free_cpu = torch.from_numpy(mi), torch.from_numpy(mask_free_np)
        if on_host or not cm.is_cpu:  # already where the kernels read it
            mask = cm.contiguous().view(torch.uint8) if cm.dtype == torch.bool else cm.contiguous()
        if on_host:
            mask_indptr, mask_free = mask_indptr_cpu, mask_free_cpu
        elif mask is not None:  # staged with the index arrays below
            staged_mask = (mi, mask_free_np)
        else:  # the host mask's bytes with them
            staged_mask = (mi, mask_free_np, m.view(np.uint8))
    elif batch.mode == ForwardMode.TARGET_VERIFY and not batch.causal:
        raise ValueError("TARGET_VERIFY without custom_mask must be causal (a chain of draft tokens)")

    if on_host:  # the host arrays are the kernel arguments
        d_qo, d_kvp, d_idx, d_last, d_kv = qo_t, kvp_t, idx_t, last_t, kv_lens_t
    else:  # one asynchronous copy of the arrays packed (the mask's arrays with them)
        d_qo, d_kvp, d_last, d_kv, d_idx, *d_mask = to_device((qo, kvp, last, kv_lens, idx, *staged_mask), device)
        if d_mask:
            mask_indptr, mask_free = d_mask[0], d_mask[1]
            if len(d_mask) > 2:
                mask = d_mask[2]
    return Plan(
        config=config,
        mode=batch.mode,
        batch_size=bsz,
        num_tokens=int(qo[-1]),
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        causal=bool(batch.causal) if mask is None else False,
        device=device,
        qo_indptr=d_qo,
        kv_indptr=d_kvp,
        kv_indices=d_idx,
        kv_last_page_len=d_last,
        kv_lens=d_kv,
        qo_indptr_cpu=qo_t,
        kv_indptr_cpu=kvp_t,
        kv_indices_cpu=idx_t,
        kv_last_page_len_cpu=last_t,
        q_lens_cpu=q_lens_t,
        kv_lens_cpu=kv_lens_t,
        mask=mask,
        mask_indptr=mask_indptr,
        mask_indptr_cpu=mask_indptr_cpu,
        mask_free=mask_free,
        mask_free_cpu=mask_free_cpu,
        max_page_id=max_page_id,
    )


_DEVICES: dict = {}


def _plan_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that exists here (checked once per distinct value)."""
    try:
        return _DEVICES[device]
    except (KeyError, TypeError):
        pass
    try:
        d = torch.device(device)
        if d.type != "meta":
            torch.empty(0, device=d)
    except (RuntimeError, TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"device must be a torch device available here, got {device!r} ({e})") from e
    try:
        if len(_DEVICES) < 64:
            _DEVICES[device] = d
    except TypeError:
        pass
    return d


def check_run_bounds(
    plan: Plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> None:
    """The per-layer guard of ``PagedAttention.run`` (a few integer compares, no device work): the
    kernels index ``q`` / ``out`` up to ``plan.num_tokens`` rows and the caches up to page
    ``plan.max_page_id``, so smaller tensors would be read (written) out of bounds.

    Raises:
        ValueError: naming the argument; :func:`check_run_inputs` checks everything else once.
    """
    n, top = plan.num_tokens, plan.max_page_id
    if q.shape[0] < n or (out is not None and out.shape[0] < n) or k_cache.shape[0] <= top or v_cache.shape[0] <= top:
        for name, t, need in (("q", q, n), ("out", out, n)):
            if t is not None and t.shape[0] < need:
                raise ValueError(f"{name} must have >= num_tokens={need} rows (the plan's), got {t.shape[0]}")
        name, t = ("k_cache", k_cache) if k_cache.shape[0] <= top else ("v_cache", v_cache)
        raise ValueError(f"{name} has {t.shape[0]} pages but the plan's kv_indices reach page {top}")


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
        want = config.dtype if name == "q" else config.kv_dtype  # fp8 KV: the cache's own dtype
        if t.dtype != want:
            raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    exp_c = config.kv_cache_shape(k_cache.shape[0])
    if config.is_mla:
        from .mla import check_latent_views  # noqa: PLC0415

        check_latent_views(config, k_cache, v_cache)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if config.is_mla and name == "v_cache":
            continue
        if tuple(t.shape) != exp_c:
            raise ValueError(f"{name} must have shape {list(exp_c)} ({config.kv_layout} layout), got {list(t.shape)}")
    if plan.kv_indices_cpu.numel() and int(plan.kv_indices_cpu.max()) >= k_cache.shape[0]:
        raise ValueError(f"kv_indices must be < num_pages={k_cache.shape[0]}")
