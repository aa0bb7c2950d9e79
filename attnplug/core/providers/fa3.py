"""The ``fa3`` provider: FlashAttention-3 (Hopper) on the paged cache, block-table dialect.

FA3 build, first importable wins (the startup log names it):

1. ``flash_attn_interface`` - FlashAttention's own hopper build (a source build of
   ``flash-attention/hopper``): ``flash_attn_with_kvcache(page_table=, cache_seqlens=, cu_seqlens_q=)``.
2. ``sgl_kernel.flash_attn`` - SGLang's copy, same ``flash_attn_with_kvcache`` signature.
3. ``vllm.vllm_flash_attn.flash_attn_interface`` - vLLM's fork (what ``shared/tools/gpu-wheels.sh``
   packs as fa3.zip): ``flash_attn_varlen_func(block_table=, seqused_k=, out=, fa_version=3)``.
4. ``vllm_flash_attn.flash_attn_interface`` - the same fork as a standalone top-level package (the
   ``vllm-flash-attn`` layout): lets an SGLang environment use vLLM's FA3 build without a ``vllm``
   package shadowing anything.

All four are the same Hopper kernel: varlen q (``cu_seqlens_q`` = ``qo_indptr``), paged KV read via a
``[B, max_pages]`` block table + per-request ``seqused_k`` (built on device in ``plan`` from the CSR
table), bottom-right causal mask, ``window_size=(window_left, 0)``, ``softcap``, natural-log LSE
``[Hq, T]``. The block table may use any page size (FA3 docstring: "page_block_size can be
arbitrary"); KV must be NHD (``[num_pages, P, Hkv, D]``), HND is refused.

TARGET_VERIFY with a tree mask (FA3 has no arbitrary mask) is split in two and merged by LSE:

* prefix: the keys before the draft tokens, which the mask must show to every draft token (checked
  in ``plan``; otherwise ``UnsupportedFeature``) -> FA3 non-causal over the mask's leading all-visible
  columns (``seqused_k = mask_free >= kv_len - q_len``, the plan's);
* tree: the keys after them (``kv_start = mask_free``) with the custom mask -> attnplug's own
  Triton kernel (planned once in ``plan``, output and LSE into float32 buffers held by the plan);
* ``attnplug.core.kernels.merge.merge_state`` (natural-log LSE, strided: FA3's ``[Hq, T]`` LSE is
  read in place) merges the two into ``out``/``lse``.

fp8 KV cache (``torch.float8_e4m3fn`` only: FA3 has no e5m2 kernels; model dtype bfloat16 only: its
fp8 kernels write bfloat16) as vLLM's FLASH_ATTN runs it on Hopper: ``run`` quantizes q to e4m3 with
``q_scale`` (saturated, like the KV write; one Triton launch into a buffer of the plan) and passes
``q_descale`` / ``k_descale`` / ``v_descale`` = the layer's scale tensors expanded to
``[num_seqs, Hkv]`` (views: device reads, captured by graphs). The tree part of a tree verify is
attnplug's Triton kernel, which dequantizes the fp8 cache itself and reads the same e4m3-rounded
query (``q8 * q_scale``, written by the quantize launch), so both parts see one query.

Attention sinks (``config.sinks``): a build whose entry point takes them (vLLM's fork: ``s_aux``;
sgl_kernel: ``sinks``; bfloat16 logits, at most 64 query heads, as the engines' gpt-oss passes them)
computes them in its kernel where ``run`` writes no LSE and the plan has no tree part; otherwise (the LSE
asked, a tree verify, float32 sinks, a build without the argument) the core's exact join
(:meth:`~attnplug.core.providers.base.Provider.run_folded`).

Sliding window together with a tree mask is refused. ``run`` does no host work, no sync and no
allocation of attnplug's own (the FA3 libraries allocate their LSE themselves). hopper/sgl_kernel
builds have no ``out=`` argument, so their result is copied into ``out``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..config import AttentionConfig, UnsupportedFeature
from ..graph_views import HostBatch
from ..pages import num_pages
from ..plan import Plan, ProviderState
from .base import GraphSupport, Provider, ProviderGraph, RaggedKernel

logger = logging.getLogger("attnplug")
_nnz = np.count_nonzero

HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class FA3Lib:
    """One importable FA3 build behind a single paged call."""

    source: str
    fn: Callable
    varlen_style: bool  # vLLM's flash_attn_varlen_func (out=, block_table=) vs *_with_kvcache

    @cached_property
    def sink_arg(self) -> str | None:
        """The keyword of the build's per-head sink logits (vLLM's fork: ``s_aux``, sgl_kernel: ``sinks``),
        or ``None`` where its entry point has none."""
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            return None
        return next((k for k in ("s_aux", "sinks") if k in params), None)

    def takes_sinks(self, sinks: torch.Tensor, num_qo_heads: int) -> bool:
        """Whether the build computes these sinks itself, exactly: it has the argument, and the FA3 kernel's
        limits hold (bfloat16 sink logits, at most 64 query heads). Otherwise the core's exact join."""
        return self.sink_arg is not None and sinks.dtype == torch.bfloat16 and num_qo_heads <= 64

    def paged(
        self,
        q,
        k_cache,
        v_cache,
        out,
        *,
        block_table,
        cu_seqlens_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        window,
        softcap,
        scale,
        return_lse,
        descale=None,
        sinks=None,
        qv=None,
    ):
        """``q [T, Hq, D]``, caches ``[num_pages, P, Hkv, D]`` -> writes ``out``; returns lse ``[Hq, T]`` or None.
        ``descale``: fp8 (q, k, v all e4m3): ``{"q_descale": ..., "k_descale": ..., "v_descale": ...}``,
        each ``[num_seqs, Hkv]`` float32 (every build takes these keyword arguments). ``sinks``: ``[Hq]``
        bfloat16 sink logits, through :attr:`sink_arg` (only where :meth:`takes_sinks`). ``qv [T, Hq, Dv]``:
        FA3's MLA input (the absorbed query part that multiplies ``v_cache``; vLLM's fork: ``q_v``)."""
        fp8 = dict(descale or {})
        if sinks is not None:
            fp8[self.sink_arg] = sinks
        if qv is not None:
            fp8["q_v" if self.varlen_style else "qv"] = qv
        if self.varlen_style:
            r = self.fn(
                q,
                k_cache,
                v_cache,
                max_seqlen_q,
                cu_seqlens_q,
                max_seqlen_k,
                seqused_k=seqused_k,
                softmax_scale=scale,
                causal=causal,
                window_size=list(window),
                softcap=softcap,
                block_table=block_table,
                return_softmax_lse=return_lse,
                out=out,
                fa_version=3,
                **fp8,
            )
        else:
            r = self.fn(
                q,
                k_cache,
                v_cache,
                cache_seqlens=seqused_k,
                page_table=block_table,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=max_seqlen_q,
                softmax_scale=scale,
                causal=causal,
                window_size=tuple(window),
                softcap=softcap,
                return_softmax_lse=return_lse,
                **fp8,
            )
        o, s = (r[0], r[1]) if return_lse else (r, None)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o.view_as(out))
        return s

    def ragged(self, q, k, v, out, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale) -> None:
        """Cache-free varlen call (vLLM's fork only, :attr:`varlen_style`): ``q [Tq, Hq, D]``, ``k [Tk, Hkv,
        D]``, ``v [Tk, Hkv, Dv]`` -> writes ``out [Tq, Hq, Dv]``."""
        o = self.fn(
            q,
            k,
            v,
            max_seqlen_q,
            cu_seqlens_q,
            max_seqlen_k,
            cu_seqlens_k=cu_seqlens_k,
            softmax_scale=scale,
            causal=causal,
            out=out,
            fa_version=3,
        )
        if o.data_ptr() != out.data_ptr():
            out.copy_(o.view_as(out))


_LIB: FA3Lib | None = None


def _hopper() -> Callable:
    import flash_attn_interface as m  # noqa: PLC0415

    return m.flash_attn_with_kvcache


def _sgl_kernel() -> Callable:
    from sgl_kernel.flash_attn import flash_attn_with_kvcache  # noqa: PLC0415

    torch.ops.sgl_kernel.fwd.default  # noqa: B018 - the FA3 op lives in flash_ops, which may be absent
    return flash_attn_with_kvcache


def _vllm_fork(module: str) -> Callable[[], Callable]:
    """Loader of vLLM's fork at ``module`` (inside vllm or standalone): its varlen entry point,
    provided its FA3 extension loaded (the module imports without it)."""

    def load() -> Callable:
        m = importlib.import_module(module)
        if not getattr(m, "FA3_AVAILABLE", False):
            raise ImportError(getattr(m, "FA3_UNAVAILABLE_REASON", "FA3_AVAILABLE is False"))
        return m.flash_attn_varlen_func

    return load


# (name in errors, source in the startup log, loader, varlen_style), in the documented order
_BUILDS = [
    ("flash_attn_interface", "flash_attn_interface", _hopper, False),
    ("sgl_kernel.flash_attn", "sgl_kernel.flash_attn", _sgl_kernel, False),
    (
        "vllm.vllm_flash_attn",
        "vllm.vllm_flash_attn (fa_version=3)",
        _vllm_fork("vllm.vllm_flash_attn.flash_attn_interface"),
        True,
    ),
    (
        "vllm_flash_attn",
        "vllm_flash_attn (standalone, fa_version=3)",
        _vllm_fork("vllm_flash_attn.flash_attn_interface"),
        True,
    ),
]


def load_fa3() -> FA3Lib:
    """Import the first available FA3 build (see module docstring); cached.

    Raises:
        ProviderUnavailable: none imports; the message lists each attempt.
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    errors = []
    for name, source, load, varlen_style in _BUILDS:
        try:
            _LIB = FA3Lib(source, load(), varlen_style)
            return _LIB
        except Exception as e:  # ImportError, or a broken install
            errors.append(f"{name}: {e!r}")
    raise FA3Provider.unavailable("no FlashAttention-3 build imports; tried: " + "; ".join(errors))


@dataclass
class FA3Args:
    """Arguments of one paged FA3 call (:meth:`FA3Lib.paged`)."""

    block_table: torch.Tensor  # [B, W] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seqused_k: torch.Tensor  # [B] int32 keys per request
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: tuple[int, int]
    softcap: float
    scale: float


@dataclass
class FA3Tree:
    """The tree part of a tree-masked verify: attnplug's Triton kernel on keys ``>= prefix_lens[b]``
    and the scratch its LSE merge with FA3's prefix part uses."""

    prefix_lens: torch.Tensor  # [B] int32 on the device: FA3's keys per request (the plan's mask_free)
    tree_plan: Plan
    prefix_out: torch.Tensor  # [T, Hq, D] dtype
    tree_out: torch.Tensor  # [T, Hq, D] float32
    tree_lse: torch.Tensor  # [T, Hq] float32
    q_deq: torch.Tensor | None = None  # fp8 KV: [T, Hq, D] dtype, the e4m3-rounded query times q_scale


@dataclass
class FA3State(ProviderState):
    """``plan.state``: the FA3 call, and the tree part of a tree-masked verify (else ``None``);
    fp8 KV: ``q8`` the ``[T, Hq, D]`` e4m3 buffer q is quantized into, ``num_seqs`` the descale rows."""

    args: FA3Args
    tree: FA3Tree | None
    q8: torch.Tensor | None = None
    num_seqs: int = 0


class FA3Graph(ProviderGraph):
    """FA3 under CUDA graphs: a padded block table ``[max_batch, ceil(max_seq_len / P)]`` read by FA3
    (``max_seqlen_k = max_seq_len``), rewritten in place before each replay - by the graph state's
    one-launch update from a device page table, or here from the static CSR (``GraphState.update``).
    Verify: FA3 on the prefix (``seqused_k = mask_free = kv_len - q``, the static view) and the Triton
    kernel on the tree part over static tiles (one split), LSE-merged."""

    def __init__(self, provider: FA3Provider, gs):
        super().__init__(provider, gs)
        dev, mb = gs.device, gs.max_batch
        self.tree_static = self.tree_bufs = None
        if gs.mode == "verify":
            provider.check_tree_config()
            self.tree_static = provider.tree_provider().static_buffers(
                max_rows=mb, max_tokens=gs.max_tokens, max_kv_len=gs.max_seq_len, q=gs.q, num_kv_splits=1
            )
            self.tree_bufs = provider.tree_buffers(gs.max_tokens, dev)
        w = num_pages(gs.max_seq_len, provider.config.page_size)
        self.q8 = provider.q8_buffer(gs.max_tokens)  # fp8 KV: the quantized q, static
        self.block_table = torch.zeros(mb, w, dtype=torch.int32, device=dev)
        self._bt_idx = torch.zeros(mb, w, dtype=torch.int64, device=dev)
        self._bt_col = torch.arange(w, dtype=torch.int64, device=dev)

    def plan(self, plan: Plan, bs: int) -> None:
        p, gs = self.provider, self.gs
        cfg, v = p.config, gs.static_views(bs)
        w = cfg.window_left
        args = FA3Args(
            block_table=self.block_table[:bs],
            cu_seqlens_q=v.qo_indptr,
            seqused_k=v.kv_lens,
            max_seqlen_q=gs.q,
            max_seqlen_k=gs.max_seq_len,
            causal=True,
            window=(w, 0) if w >= 0 else (-1, -1),
            softcap=cfg.logits_soft_cap,
            scale=cfg.scale,
        )
        tree = None
        if gs.mode == "verify":  # prefix = the mask-free columns (kv_len - q), the tree part after it
            prefix = v.mask_free
            args.seqused_k, args.causal, args.window = prefix, False, (-1, -1)
            tree = p.plan_tree_part(
                plan, prefix, static=self.tree_static, buffers={k: b[: bs * gs.q] for k, b in self.tree_bufs.items()}
            )
        plan.state = FA3State(args, tree, None if self.q8 is None else self.q8[: bs * gs.q], bs)

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        """Block-table rows from the static CSR, on the device (the one-launch update wrote them already)."""
        if device_table:
            return
        gs = self.gs
        gather_block_table(
            gs.kv_indptr[: bs + 1], gs.kv_indices, self._bt_col, out=self.block_table[:bs], idx=self._bt_idx[:bs]
        )


class FA3Ragged(RaggedKernel):
    """FA3's cache-free varlen call (``cu_seqlens_k``), as vLLM's MLA prefill calls it: head dims of
    :data:`HEAD_DIMS` with ``Dv = D``, or DeepSeek's 192 / 128. Refused (at construction) on a build
    whose entry point is ``flash_attn_with_kvcache`` only."""

    LIBRARY, HEAD_DIMS, DIM_PAIRS = "FA3", HEAD_DIMS, ((192, 128),)

    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        self.lib = load_fa3()
        if not self.lib.varlen_style:
            raise UnsupportedFeature(
                f"attnplug: provider 'fa3' does not support ragged prefill through {self.lib.source} (attnplug calls "
                "the cache-free varlen entry of vLLM's FA3 fork only)"
            )

    def run(self, plan, q, k, v, out) -> None:
        self.lib.ragged(
            q,
            k,
            v,
            out,
            cu_seqlens_q=plan.cu_q,
            cu_seqlens_k=plan.cu_k,
            max_seqlen_q=plan.max_q,
            max_seqlen_k=plan.max_k,
            causal=plan.causal,
            scale=self.config.scale,
        )


def gather_block_table(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    cols: torch.Tensor,
    out: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """FA3's ``block_table [B, W]`` (``W = cols.numel()``, ``cols = arange(W)``) from the CSR, on its
    device with no sync: ``block_table[b, j] = kv_indices[kv_indptr[b] + j]``, clamped to the last
    entry, so the entries past a row's own pages are some valid page id (FA3 reads only the
    ``ceil(seqused_k / P)`` first of a row). ``out`` / ``idx`` (``[B, W]`` int32 / int64): in place."""
    B, W = kv_indptr.numel() - 1, cols.numel()
    if out is None:  # every entry is written below (or zeroed for an empty batch)
        out = torch.empty(B, W, dtype=torch.int32, device=kv_indices.device)
    if kv_indices.numel() == 0 or B == 0:
        return out.zero_()
    idx = torch.add(kv_indptr[:-1, None], cols[None, :], out=idx)
    idx.clamp_(max=kv_indices.numel() - 1)
    torch.index_select(kv_indices, 0, idx.view(-1), out=out.view(-1))
    return out


class FA3Provider(Provider):
    """FlashAttention-3 paged attention; tree-masked verify = FA3 prefix + Triton tree part, LSE-merged."""

    name = "fa3"
    graph_support = GraphSupport(decode=True, verify=True, device_refresh=True, cascade=True)
    graph_cls = FA3Graph
    KV_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float8_e4m3fn))  # FA3 has no e5m2 kernels
    MLA_IMPL = ".fa3_mla:FA3MLAProvider"
    RAGGED_IMPL = ".fa3:FA3Ragged"

    def __init__(self, config: AttentionConfig, device: torch.device):
        super().__init__(config, device)
        self.lib = load_fa3()
        self._tree = self._merge = None  # tree-verify part: attnplug's Triton kernel + LSE merge
        self._cols: torch.Tensor | None = None  # arange of block-table columns (device), grown as needed
        logger.info("attnplug: fa3 provider uses %s", self.lib.source)

    @classmethod
    def check_capability(cls, major: int, minor: int) -> str | None:
        return None if major == 9 else f"compute capability sm{major}{minor} (FA3 runs on Hopper, sm90, only)"

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise cls.unavailable(f"it needs a Hopper CUDA GPU; got device {str(device)!r}")
        why = cls.check_capability(*torch.cuda.get_device_capability(device))
        if why is not None:
            raise cls.unavailable(f"this GPU has {why}")
        load_fa3()

    def check_config(self, config: AttentionConfig) -> None:
        if config.dtype not in (torch.float16, torch.bfloat16):
            raise self.unsupported(f"dtype {config.dtype} (FA3 runs float16/bfloat16)")
        if config.head_dim not in HEAD_DIMS:
            raise self.unsupported(f"head_dim={config.head_dim} (FA3 kernels: {HEAD_DIMS})")
        if config.kv_layout != "NHD":
            raise self.unsupported("kv_layout='HND' (FA3 reads paged KV as [num_pages, page_size, Hkv, D])")
        if config.kv_quantized and config.dtype != torch.bfloat16:
            raise self.unsupported(
                f"an fp8 KV cache with dtype {config.dtype} (FA3's fp8 kernels take an fp8 "
                "query and write bfloat16: bfloat16 models only)"
            )

    def q8_buffer(self, num_tokens: int) -> torch.Tensor | None:
        """fp8 KV: the ``[num_tokens, Hq, D]`` e4m3 buffer ``run`` quantizes q into; else ``None``."""
        cfg = self.config
        if not cfg.kv_quantized:
            return None
        return torch.empty(num_tokens, cfg.num_qo_heads, cfg.head_dim, dtype=cfg.kv_dtype, device=self.device)

    def plan(self, plan: Plan, static=None) -> None:
        """Block table + seq lens on device; for a tree mask also the split into prefix and tree parts.

        A one-request plan reads its own tensors: ``block_table = kv_indices.view(1, n)``,
        ``seqused_k = kv_lens`` (views, no copy), so rewriting them in place re-targets the plan
        (the cascade prefix part of a decode graph). Others: a ``[B, max_pages]`` block table
        gathered from the CSR on the device (:func:`gather_block_table`), ``seqused_k = kv_lens``."""
        cfg = self.config
        max_pages = max(1, num_pages(plan.max_kv_len, cfg.page_size))
        n = plan.kv_indices.numel()
        if plan.batch_size == 1 and n >= max_pages:
            block_table, seq_lens = plan.kv_indices.view(1, n), plan.kv_lens[:1]
        else:  # on the device, no sync; seqused_k = the plan's kv_lens
            if self._cols is None or self._cols.numel() < max_pages:
                self._cols = torch.arange(
                    max(max_pages, 2 * (0 if self._cols is None else self._cols.numel())),
                    dtype=torch.int32,
                    device=self.device,
                )
            block_table, seq_lens = (
                gather_block_table(plan.kv_indptr, plan.kv_indices, self._cols[:max_pages]),
                plan.kv_lens,
            )
        window = (cfg.window_left, 0 if plan.causal else -1) if cfg.window_left >= 0 else (-1, -1)
        args = FA3Args(
            block_table=block_table,
            cu_seqlens_q=plan.qo_indptr,
            seqused_k=seq_lens,
            max_seqlen_q=max(plan.max_q_len, 1),
            max_seqlen_k=max(plan.max_kv_len, 1),
            causal=plan.causal,
            window=window,
            softcap=cfg.logits_soft_cap,
            scale=cfg.scale,
        )
        tree = None
        if plan.mask is not None:
            tree = self._plan_tree(plan)
            args.seqused_k, args.causal, args.window = tree.prefix_lens, False, (-1, -1)
            free = plan.mask_free_cpu.numpy()
            args.max_seqlen_k = max(int(free[free.argmax()]), 1) if free.shape[0] else 1
        plan.state = FA3State(args, tree, self.q8_buffer(plan.num_tokens), plan.batch_size)

    def check_tree_config(self) -> None:
        """Raise if this config cannot run a tree-masked verify (FA3 computes the prefix unmasked)."""
        if self.config.window_left >= 0:
            raise self.unsupported("a custom (tree) mask together with a sliding window")

    def _plan_tree(self, plan: Plan) -> FA3Tree:
        """Check the mask's prefix columns are all visible; plan the tree part. FA3's part covers each
        request's ``mask_free`` leading columns (which every query sees; make_plan counted them, on the
        device already), the tree part the rest: the draft keys, and fewer where the tree shows its
        first draft keys to every query (as the CUDA-graph path splits)."""
        self.check_tree_config()
        free = plan.mask_free_cpu.numpy()
        hidden = free < plan.kv_lens_cpu.numpy() - plan.q_lens_cpu.numpy()
        if _nnz(hidden):
            b = int(hidden.argmax())
            raise self.unsupported(
                f"a tree mask that hides part of the prefix (request {b}): FA3 computes the prefix "
                "without a mask; only the last q_len x q_len block may be arbitrary"
            )
        return self.plan_tree_part(plan, plan.mask_free)

    def tree_provider(self):
        """attnplug's Triton provider for the tree part (triton is imported only once a tree is planned)."""
        if self._tree is None:
            from ..kernels.merge import merge_state  # noqa: PLC0415
            from .triton import TritonProvider  # noqa: PLC0415

            self._tree, self._merge = TritonProvider(self.config, self.device), merge_state
        return self._tree

    def tree_buffers(self, num_tokens: int, device) -> dict:
        """Scratch of the tree-verify split for ``num_tokens`` rows: ``prefix_out [T, Hq, D]`` (dtype),
        ``tree_out [T, Hq, D]`` and ``tree_lse [T, Hq]`` float32 (``D``: the value head dim); fp8 KV:
        ``q_deq [T, Hq, D]`` (dtype)."""
        cfg, hd = self.config, (num_tokens, self.config.num_qo_heads, self.config.head_dim_v)
        bufs = dict(
            prefix_out=torch.empty(hd, dtype=cfg.dtype, device=device),
            tree_out=torch.empty(hd, dtype=torch.float32, device=device),
            tree_lse=torch.empty(hd[:2], dtype=torch.float32, device=device),
        )
        if cfg.kv_quantized:
            bufs["q_deq"] = torch.empty((*hd[:2], cfg.head_dim), dtype=cfg.dtype, device=device)
        return bufs

    def plan_tree_part(self, plan: Plan, prefix: torch.Tensor, static=None, buffers: dict | None = None) -> FA3Tree:
        """The tree part of a verify ``plan``: attnplug's Triton kernel on keys ``>= prefix[b]``
        (``[B]`` int32 on the device; one split), LSE-merged with FA3's prefix part in :meth:`run`.
        ``static`` (the Triton provider's static buffers) / ``buffers`` (:meth:`tree_buffers`): static
        storage (CUDA graphs). Callers run :meth:`check_tree_config` first."""
        tree = self.tree_provider()
        tree_plan = plan.replace(options=tree.Options(kv_start=prefix, num_kv_splits=1), state=None)
        tree.plan(tree_plan, static=static)
        return FA3Tree(
            prefix_lens=prefix, tree_plan=tree_plan, **(buffers or self.tree_buffers(plan.num_tokens, plan.device))
        )

    def run(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        host_scales=None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """``q [T, Hq, D]``, caches ``[num_pages, P, Hkv, D]`` -> ``out [T, Hq, D]`` (+ natural-log ``lse [T, Hq]``).
        fp8 KV: one-element float32 scale tensors (see the module docstring). ``sinks``: the build's own
        sink argument where it has one, no LSE is asked and the plan has no tree part, else
        :meth:`run_folded`."""
        if sinks is not None:
            if lse is None and plan.state.tree is None and self.lib.takes_sinks(sinks, self.config.num_qo_heads):
                self._run(plan, q, k_cache, v_cache, out, None, False, k_scale, v_scale, q_scale, sinks=sinks)
                return
            return self.run_folded(
                plan, q, k_cache, v_cache, out, lse, sinks, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale
            )
        s = self._run(plan, q, k_cache, v_cache, out, lse, lse is not None, k_scale, v_scale, q_scale)
        if s is not None:
            lse.copy_(s)

    def graph_prefix_provider(self) -> Provider:
        """The triton provider where it runs here: its prefix part is one launch that merges into FA3's
        suffix state in the kernel and returns at once when the batch shares nothing (an FA3 call and a
        merge are two launches that replay either way); else a fork of this one, whose plans cannot follow
        the groups of a replay (:meth:`~.base.Provider.graph_tile_list` refuses them)."""
        from . import provider_instance  # noqa: PLC0415
        from .base import ProviderUnavailable  # noqa: PLC0415

        try:
            return provider_instance("triton", self.config, self.device).fork()
        except (ProviderUnavailable, UnsupportedFeature, ImportError):
            return self.fork()

    def run_lse(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        host_scales=None,
    ) -> torch.Tensor:
        """:meth:`run`, the LSE returned as a ``[T, Hq]`` view of FA3's own ``[Hq, T]`` (no copy); tree plans
        write ``lse`` and return it."""
        s = self._run(plan, q, k_cache, v_cache, out, lse, True, k_scale, v_scale, q_scale)
        return lse if s is None else s

    def library_inputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        """``(q, k_cache, v_cache, extra keyword arguments)`` of the FA3 call (the MLA class splits them)."""
        return q, k_cache, v_cache, {}

    def _run(
        self,
        plan: Plan,
        q,
        k_cache,
        v_cache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        want_lse: bool,
        k_scale,
        v_scale,
        q_scale,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The launches of :meth:`run`; returns FA3's LSE as a ``[T, Hq]`` view when ``want_lse`` and the plan
        has no tree (else ``None``: a tree plan writes ``lse`` itself). ``sinks`` (no tree, no LSE): the
        build's sink argument (:meth:`FA3Lib.takes_sinks`)."""
        st: FA3State = plan.state
        a = vars(st.args)  # no copy: FA3Args' fields are paged()'s keyword arguments
        tree = st.tree
        q_fa, descale, scales = q, None, {}
        if st.q8 is not None:  # fp8: q quantized like vLLM's query quant; per-(seq, kv head) descales are views
            from ..kernels.kv_write import quantize_fp8_rows  # noqa: PLC0415 - triton only when fp8 runs

            q_fa = quantize_fp8_rows(
                q, q_scale, st.q8[: q.shape[0]], None if tree is None else tree.q_deq[: q.shape[0]]
            )
            shape = (st.num_seqs, self.config.num_kv_heads)
            descale = dict(
                q_descale=q_scale.reshape(1, 1).expand(shape),
                k_descale=k_scale.reshape(1, 1).expand(shape),
                v_descale=v_scale.reshape(1, 1).expand(shape),
            )
            scales = dict(k_scale=k_scale, v_scale=v_scale)
        q_fa, k_fa, v_fa, extra = self.library_inputs(q_fa, k_cache, v_cache)
        if tree is None:
            s = self.lib.paged(q_fa, k_fa, v_fa, out, return_lse=want_lse, descale=descale, sinks=sinks, **a, **extra)
            return s.t() if want_lse else None
        s_a = self.lib.paged(q_fa, k_fa, v_fa, tree.prefix_out, return_lse=True, descale=descale, **a, **extra)
        q_tree = q if st.q8 is None else tree.q_deq[: q.shape[0]]  # fp8: the query FA3's part reads
        self._tree.run(tree.tree_plan, q_tree, k_cache, v_cache, tree.tree_out, tree.tree_lse, **scales)
        self._merge(tree.prefix_out, s_a.t(), tree.tree_out, tree.tree_lse, out, lse)
        return None
