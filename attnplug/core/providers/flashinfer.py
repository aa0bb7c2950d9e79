"""The ``flashinfer`` provider: FlashInfer's paged-KV wrappers behind the core's plan/run contract.

Kernels (flashinfer-python >= 0.6; written against 0.6.14):

* DECODE: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` (the prefill template run
  as decode; faster than the CUDA-core kernel: ``docs/measured-choices.md``).
* EXTEND / MIXED / DRAFT_EXTEND / chain TARGET_VERIFY: ``BatchPrefillWithPagedKVCacheWrapper``,
  causal bottom-right; backend ``"fa3"`` (Hopper template) where supported, else ``"fa2"``.
* TARGET_VERIFY with a tree mask: the same wrapper with ``custom_mask`` (FlashInfer packs the bool
  mask into bits inside its ``plan``); custom masks only exist in the ``"fa2"`` template.

Backend knob: ``attn.plan(batch, prefill_backend="fa2" | "fa3" | "auto")`` or the environment
variable ``ATTNPLUG_FLASHINFER_BACKEND``; ``"auto"`` (default) picks ``"fa3"`` on sm90, else ``"fa2"``.

``plan`` calls exactly one wrapper ``plan`` per forward (host work, JIT compile on first use);
``plan.state`` is a :class:`FlashInferState`.
``run`` calls only ``wrapper.run(q, (k_cache, v_cache), out=out, lse=lse)``: no allocation, no sync.
One wrapper holds one plan: planning again replaces the previous forward's plan (FlashInfer semantics).

fp8 KV cache (e4m3 / e5m2, ``kv_data_type``; q stays in the model dtype): FlashInfer's "fa2"
templates, which dequantize K/V in shared memory (its sm90 "fa3" template needs an fp8 query: not
used, an explicit ``prefill_backend="fa3"`` is refused). FlashInfer takes ``k_scale`` / ``v_scale``
as host floats (folded into ``sm_scale``, and an ``out *= v_scale`` after the kernel unless
``v_scale == 1.0``). Where the engine fixes the scales for the process (its own FlashInfer backend
reads the same floats), the adapter passes them as ``host_scales`` and ``run`` hands them to
FlashInfer (no extra launch for unit scales). Otherwise attnplug's scales are device tensors (in-place
updates, CUDA graphs) and ``run`` applies them on the device: ``q * k_scale`` into a buffer of the
plan (one elementwise launch; logits ``(q k_scale) . k8``) and ``out *= v_scale``.

LSE: FlashInfer writes base-2 log-sum-exp; the core's contract is natural log, so when ``lse`` is
requested ``run`` rescales it in place (``lse *= ln 2``; one elementwise kernel, no allocation).
``lse`` must be a contiguous ``[T, Hq]`` float32 tensor on the device.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import FP8_KV_DTYPES, AttentionConfig
from ..graph_views import HostBatch
from ..metadata import ForwardMode
from ..plan import Plan, PlanOptions, ProviderState
from .base import GraphSupport, Provider, ProviderGraph, RaggedKernel

logger = logging.getLogger("attnplug")

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)
HEAD_DIMS = (64, 128, 256)
#: FlashInfer releases this provider has run against on a GPU (docs/compatibility.md); others get a
#: warning, and are refused when a call the provider makes no longer fits (:func:`interface_refusal`)
TESTED_VERSIONS = ("0.6.14",)
_INTERFACE: dict[str, str | None] = {}  # interface_refusal per installed version, checked once a process


@dataclass(frozen=True)
class LibraryCall:
    """One call this provider makes into FlashInfer: ``name`` in ``module`` (``Class.method``; ``A|B``: the
    first that exists) takes ``npos`` positional arguments (after ``self``) and the keywords ``kwargs``."""

    module: str
    name: str
    npos: int
    kwargs: tuple[str, ...] = ()
    required: bool = True
    why: str = ""


def _calls() -> tuple[LibraryCall, ...]:
    dec, pre = "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"
    mla, mla_mod = "BatchMLAPagedAttentionWrapper", "flashinfer.mla._core"  # 0.7: re-exported there
    numerics = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "sm_scale")
    run = ("out", "lse", "return_lse", "k_scale", "v_scale")
    return (
        LibraryCall(
            "flashinfer.decode",
            f"{dec}.__init__",
            2,
            (
                "use_cuda_graph",
                "use_tensor_cores",
                "paged_kv_indptr_buffer",
                "paged_kv_indices_buffer",
                "paged_kv_last_page_len_buffer",
            ),
            why="decode wrappers (eager and CUDA-graph)",
        ),
        LibraryCall(
            "flashinfer.decode",
            f"{dec}._plan_impl|{dec}.plan",
            7,
            numerics,
            why="decode plan: (indptr, indices, last_page_len, Hq, Hkv, D, P) + numerics",
        ),
        LibraryCall("flashinfer.decode", f"{dec}.run", 2, run, why="decode run: (q, (k, v))"),
        LibraryCall(
            "flashinfer.prefill",
            f"{pre}.__init__",
            2,
            (
                "backend",
                "use_cuda_graph",
                "qo_indptr_buf",
                "paged_kv_indptr_buf",
                "paged_kv_indices_buf",
                "paged_kv_last_page_len_buf",
                "custom_mask_buf",
                "mask_indptr_buf",
            ),
            why="prefill / verify wrappers",
        ),
        LibraryCall(
            "flashinfer.prefill",
            f"{pre}.plan",
            8,
            ("custom_mask", "causal", *numerics),
            why="prefill plan: (qo_indptr, kv_indptr, kv_indices, last_page_len, Hq, Hkv, D, P) + mask + numerics",
        ),
        LibraryCall("flashinfer.prefill", f"{pre}.run", 2, run, why="prefill run: (q, (k, v))"),
        LibraryCall(
            mla_mod,
            f"{mla}.__init__",
            1,
            ("use_cuda_graph", "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"),
            why="MLA wrappers (eager and CUDA-graph)",
        ),
        LibraryCall(
            mla_mod,
            f"{mla}.plan",
            12,
            why="MLA plan: (qo_indptr, kv_indptr, kv_indices, kv_lens, H, R, Dr, P, causal, scale, dtypes)",
        ),
        LibraryCall(
            mla_mod,
            f"{mla}.run",
            4,
            ("out", "lse", "return_lse", "return_lse_base_on_e"),
            why="MLA run: (q_nope, q_pe, ckv, kpe)",
        ),
        LibraryCall(
            "flashinfer.utils",
            "is_sm90a_supported",
            1,
            required=False,
            why="the fa3 template's check (a capability fallback exists)",
        ),
    )


#: every call this provider makes into FlashInfer (``attnplug.compat.flashinfer`` holds them against the
#: sources of each release in the tests; :func:`interface_refusal` against the installed one at startup)
CALLS = _calls()


def _call_problem(call: LibraryCall, import_module) -> str | None:
    """Why ``call`` does not bind on the live library (``import_module(name)`` imports its modules),
    or ``None``."""
    import inspect  # noqa: PLC0415

    try:
        module = import_module(call.module)
    except Exception as e:  # a module moved or fails to import
        return f"{call.module}: cannot import ({e!r})" if call.required else None
    for name in call.name.split("|"):
        owner, fn = None, module
        for part in name.split("."):
            owner, fn = fn, getattr(fn, part, None)
        if fn is not None:
            break
    else:
        return f"{call.module}.{call.name} is gone" if call.required else None
    # a plain function found on a class is called through an instance: ``self`` comes first
    self_arg = (
        (0,)
        if isinstance(owner, type)
        and inspect.isfunction(fn)
        and not isinstance(inspect.getattr_static(owner, name.rsplit(".", 1)[-1]), staticmethod)
        else ()
    )
    try:
        inspect.signature(fn).bind(*self_arg, *range(call.npos), **dict.fromkeys(call.kwargs, 0))
    except TypeError as e:
        what = f"{call.npos} positional, keywords {list(call.kwargs)}"
        return f"{call.module}.{name} ({what}) does not bind: {e}"
    except ValueError:  # no signature to read (not a Python function)
        return f"{call.module}.{name} has no signature to check" if call.required else None
    return None


def interface_refusal(version: str, import_module=None) -> str | None:
    """``None`` when this provider can call FlashInfer ``version`` (a tested release, or one where every call
    of :data:`CALLS` still binds on the imported library), else why not, naming each change.
    ``import_module``: imports a FlashInfer module by name (default: :func:`importlib.import_module`)."""
    if version.split("+")[0] in TESTED_VERSIONS:
        return None
    import importlib  # noqa: PLC0415

    found = [p for c in CALLS if (p := _call_problem(c, import_module or importlib.import_module))]
    if not found:
        return None
    more = f" (and {len(found) - 6} more)" if len(found) > 6 else ""
    return (
        f"flashinfer {version} changed what attnplug calls: {'; '.join(found[:6])}{more}; attnplug's "
        f"provider was tested with flashinfer {', '.join(TESTED_VERSIONS)} (docs/compatibility.md)"
    )


def untested_version_warning(version: str) -> str | None:
    """The startup warning for a FlashInfer ``version`` outside :data:`TESTED_VERSIONS`, else ``None``."""
    if version.split("+")[0] in TESTED_VERSIONS:
        return None
    return (
        f"attnplug: provider 'flashinfer' runs on flashinfer {version}, which attnplug has not been tested with "
        f"(tested: {', '.join(TESTED_VERSIONS)}; docs/compatibility.md); its results are checked only by your "
        "own comparison with the engine's backend"
    )


def fa2_decode_kwargs(fi) -> dict:
    """Constructor arguments pinning a ``BatchDecodeWithPagedKVCacheWrapper`` to FlashInfer's fa2
    template (fp8 KV with a 16-bit query: its ``"auto"`` may pick the sm90 template, which reads fp8
    KV only with an fp8 query); ``{}`` on a FlashInfer whose decode wrapper has no ``backend``."""
    import inspect  # noqa: PLC0415

    params = inspect.signature(fi.BatchDecodeWithPagedKVCacheWrapper.__init__).parameters
    return {"backend": "fa2"} if "backend" in params else {}


def _import_flashinfer():
    import flashinfer  # noqa: PLC0415 (lazy: never needed to import attnplug)

    return flashinfer


@dataclass(frozen=True)
class FlashInferOptions(PlanOptions):
    """The flashinfer provider's plan knobs (``PagedAttention.plan(batch, **knobs)``; ``None``: its default).

    Attributes:
        prefill_backend: ``"auto"``, ``"fa2"`` or ``"fa3"`` (the prefill template of extend batches).
    """

    prefill_backend: str | None = None


@dataclass
class FlashInferState(ProviderState):
    """``plan.state``: the planned wrapper this forward runs and its kernel family."""

    wrapper: object
    backend: str  # "decode-tc", "fa2" or "fa3"
    q_buf: torch.Tensor | None = None  # fp8 KV: [T, Hq, D] q * k_scale


class FlashInferGraph(ProviderGraph):
    """FlashInfer under CUDA graphs: one ``use_cuda_graph=True`` wrapper per batch size over the
    graph state's static page CSR; before each replay the wrapper is planned again on the host
    (FlashInfer's replay path: its plan writes the fixed buffers the captured kernels read).

    Decode plans from host ``kv_indptr`` / ``kv_last_page_len`` and the *device* ``kv_indices``
    (a device-to-device copy, no sync): from ``GraphState.update_from_block_table`` with the
    engine's host lengths, or from ``GraphState.update``'s host twins. Verify (custom mask) plans
    from the static device buffers; FlashInfer packs the mask bits itself (a sync), so verify
    replays go through ``GraphState.update`` only - the host path that stays.
    """

    def __init__(self, provider: FlashInferProvider, gs):
        super().__init__(provider, gs)
        self.wrappers: dict[int, object] = {}
        if gs.mode == "verify":
            self.mask_bits = torch.zeros(gs.max_mask // 8 + gs.max_batch + 8, dtype=torch.uint8, device=gs.device)
            self.mask_bits_indptr = torch.zeros(gs.max_batch + 1, dtype=torch.int32, device=gs.device)

    def plan(self, plan: Plan, bs: int) -> None:
        p, gs = self.provider, self.gs
        v = gs.static_views(bs)
        fi, layout = p._fi, p.config.kv_layout
        if gs.mode == "decode":
            wr = fi.BatchDecodeWithPagedKVCacheWrapper(
                p._workspace,
                layout,
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=v.kv_indptr,
                paged_kv_indices_buffer=gs.kv_indices,
                paged_kv_last_page_len_buffer=v.kv_last_page_len,
                **p.decode_backend_kwargs(),
            )
            backend = "decode-tc"
        else:
            wr = fi.BatchPrefillWithPagedKVCacheWrapper(
                p._workspace,
                layout,
                use_cuda_graph=True,
                qo_indptr_buf=v.qo_indptr,
                paged_kv_indptr_buf=v.kv_indptr,
                paged_kv_indices_buf=gs.kv_indices,
                paged_kv_last_page_len_buf=v.kv_last_page_len,
                custom_mask_buf=self.mask_bits,
                mask_indptr_buf=self.mask_bits_indptr[: bs + 1],
                backend="fa2",
            )
            backend = "fa2"
        self.wrappers[bs] = wr
        plan.state = FlashInferState(wr, backend, p.q_buffer(bs * gs.q))

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        if host is None:
            raise ValueError(
                "attnplug: provider 'flashinfer' plans on the host: a graph replay needs host "
                "kv_indptr / kv_last_page_len (host metadata, or host_seq_lens)"
            )
        p, gs, wr = self.provider, self.gs, self.wrappers[bs]
        if gs.mode == "decode":
            wr.plan(host.kv_indptr, host.kv_indices, host.kv_last_page_len, *p.heads(), **p.plan_kwargs())
        else:
            v = gs.static_views(bs)
            mask = gs.mask[: int(host.mask_indptr[-1])].view(torch.bool)
            wr.plan(
                v.qo_indptr,
                v.kv_indptr,
                gs.kv_indices[: host.kv_indices.numel()],
                v.kv_last_page_len,
                *p.heads(),
                custom_mask=mask,
                causal=False,
                **p.plan_kwargs(),
            )

    def check_device_table_update(self, host_seq_lens: torch.Tensor | None) -> None:
        if self.gs.mode != "decode" or host_seq_lens is None:
            raise self.provider.unsupported(
                "a graph replay from a device page table without host sequence lengths, or in verify mode "
                "(FlashInfer plans on the host and packs a custom mask there: use GraphState.update)"
            )


class FlashInferChainVerifyGraph(FlashInferGraph):
    """Verify families of causal chains (``GraphState(chain=True)``: vLLM's linear spec decode, ``q`` =
    1 + k tokens a request): a ``use_cuda_graph=True`` paged-prefill wrapper per batch size, causal
    (bottom-right), over the static page CSR - no custom mask to pack. As decode, it re-plans on the
    host before each replay from host ``kv_indptr`` / ``kv_last_page_len`` and the *device*
    ``kv_indices`` that ``GraphState.update_from_block_table`` wrote (no sync); the prefill template
    is ``"fa2"`` (what SGLang's FlashInfer graphs use), ``"fa3"`` where ``ATTNPLUG_FLASHINFER_BACKEND=fa3``
    asks for it (sm90, 16-bit KV)."""

    def __init__(self, provider: FlashInferProvider, gs):
        ProviderGraph.__init__(self, provider, gs)
        self.wrappers: dict[int, object] = {}
        self.qo_indptr_host: dict[int, torch.Tensor] = {}

    def plan(self, plan: Plan, bs: int) -> None:
        p, gs = self.provider, self.gs
        v = gs.static_views(bs)
        backend = p.resolve_backend("fa3" if os.environ.get("ATTNPLUG_FLASHINFER_BACKEND") == "fa3" else "fa2")
        wr = p._fi.BatchPrefillWithPagedKVCacheWrapper(
            p._workspace,
            p.config.kv_layout,
            use_cuda_graph=True,
            qo_indptr_buf=v.qo_indptr,
            paged_kv_indptr_buf=v.kv_indptr,
            paged_kv_indices_buf=gs.kv_indices,
            paged_kv_last_page_len_buf=v.kv_last_page_len,
            backend=backend,
        )
        self.wrappers[bs] = wr
        self.qo_indptr_host[bs] = torch.arange(bs + 1, dtype=torch.int32) * gs.q
        plan.state = FlashInferState(wr, backend, p.q_buffer(bs * gs.q))

    def refresh(self, plan: Plan, bs: int, host: HostBatch | None, device_table: bool) -> None:
        if host is None:
            raise ValueError(
                "attnplug: provider 'flashinfer' plans on the host: a verify replay needs host "
                "kv_indptr / kv_last_page_len (host metadata, or host_seq_lens)"
            )
        p = self.provider
        self.wrappers[bs].plan(
            self.qo_indptr_host[bs],
            host.kv_indptr,
            host.kv_indices,
            host.kv_last_page_len,
            *p.heads(),
            causal=True,
            **p.plan_kwargs(),
        )

    def check_device_table_update(self, host_seq_lens: torch.Tensor | None) -> None:
        if host_seq_lens is None:
            raise self.provider.unsupported(
                "a verify graph replay from a device page table without host sequence lengths (FlashInfer plans "
                "on the host)"
            )


class FlashInferProvider(Provider):
    """FlashInfer paged attention (decode: tensor-core decode; extend/verify: paged prefill)."""

    name = "flashinfer"
    Options = FlashInferOptions
    graph_support = GraphSupport(
        decode=True,
        verify=True,
        device_refresh=False,
        chain_verify_from_table=True,
        reason="FlashInfer plans on the host before each replay (no in-graph metadata updates; a replay from a "
        "device page table needs host lengths, and tree verify masks are packed on the host)",
    )
    graph_cls = FlashInferGraph
    chain_graph_cls = FlashInferChainVerifyGraph
    EAGER_RUN_CAPTURABLE = False  # eager wrappers (use_cuda_graph=False) replan their buffers; graphs: FlashInferGraph
    KV_DTYPES = frozenset((torch.float16, torch.bfloat16) + FP8_KV_DTYPES)
    MLA_IMPL = ".flashinfer_mla:FlashInferMLAProvider"
    RAGGED_IMPL = ".flashinfer:FlashInferRagged"

    def __init__(self, config: AttentionConfig, device: torch.device):
        super().__init__(config, device)
        self._fi = _import_flashinfer()
        # one zeroed float workspace shared by all wrappers (they run one after another on one stream)
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple[str, str], object] = {}
        self.default_backend = self.resolve_backend(os.environ.get("ATTNPLUG_FLASHINFER_BACKEND", "auto"))
        version = str(getattr(self._fi, "__version__", "?"))
        logger.info(
            "attnplug: flashinfer %s on %s; prefill backend %r (decode: tensor cores; custom mask: fa2)",
            version,
            torch.cuda.get_device_name(device),
            self.default_backend,
        )
        warning = untested_version_warning(version)
        if warning:
            logger.warning(warning)

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise cls.unavailable(f"it needs a CUDA GPU; got device {str(device)!r}")
        try:
            fi = _import_flashinfer()
        except Exception as e:  # ImportError, or a broken install (missing CUDA libs, ABI mismatch)
            raise cls.unavailable(f"import flashinfer failed: {e!r}") from e
        version = str(getattr(fi, "__version__", "?"))
        if version not in _INTERFACE:
            _INTERFACE[version] = interface_refusal(version)
        if _INTERFACE[version]:
            raise cls.unavailable(_INTERFACE[version])

    def check_config(self, config: AttentionConfig) -> None:
        if config.dtype not in (torch.float16, torch.bfloat16):
            raise self.unsupported(f"dtype {config.dtype} (FlashInfer attention runs float16/bfloat16)")
        if config.head_dim not in HEAD_DIMS:
            raise self.unsupported(f"head_dim={config.head_dim} (FlashInfer kernels: {HEAD_DIMS})")

    def fork(self) -> FlashInferProvider:
        """A wrapper holds one plan: a fork has its own wrappers over the same workspace."""
        p = copy.copy(self)
        p._wrappers = {}
        p._base = getattr(self, "_base", self)  # keeps the config's one instance (the registry's) alive
        return p

    def resolve_backend(self, backend: str) -> str:
        """``"auto"`` -> ``"fa3"`` on sm90 (CUDA >= 12.3), else ``"fa2"``; ``"fa2"`` for an fp8 KV cache;
        checks explicit choices."""
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"prefill_backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        major, _ = torch.cuda.get_device_capability(self.device)
        try:
            from flashinfer.utils import is_sm90a_supported  # noqa: PLC0415

            sm90a = bool(is_sm90a_supported(self.device))
        except Exception:  # older/newer layout: fall back to the capability alone
            sm90a = major == 9
        if self.config.kv_quantized:  # the sm90 template reads fp8 KV only with an fp8 query
            if backend == "fa3":
                raise self.unsupported(
                    "prefill_backend='fa3' with an fp8 KV cache (FlashInfer's sm90 template needs "
                    "an fp8 query; attnplug reads fp8 KV through FlashInfer's fa2 template)"
                )
            return "fa2"
        if backend == "auto":
            return "fa3" if sm90a else "fa2"
        if backend == "fa3" and not sm90a:
            raise self.unsupported(f"prefill_backend='fa3' on sm{major}x (the fa3 template needs sm90a)")
        return backend

    def decode_backend_kwargs(self) -> dict:
        """Extra constructor arguments of a decode wrapper: fp8 KV pins FlashInfer's fa2 template
        (its "auto" would pick the sm90 template, which needs an fp8 query)."""
        return fa2_decode_kwargs(self._fi) if self.config.kv_quantized else {}

    def q_buffer(self, num_tokens: int) -> torch.Tensor | None:
        """fp8 KV: the ``[num_tokens, Hq, D]`` buffer ``run`` writes ``q * k_scale`` into; else ``None``."""
        if not self.config.kv_quantized:
            return None
        cfg = self.config
        return torch.empty(num_tokens, cfg.num_qo_heads, cfg.head_dim, dtype=cfg.dtype, device=self.device)

    def _wrapper(self, kind: str, backend: str):
        key = (kind, backend)
        w = self._wrappers.get(key)
        if w is None:
            layout = self.config.kv_layout
            if kind == "decode":
                w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, layout, use_tensor_cores=True, **self.decode_backend_kwargs()
                )
            else:
                w = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, layout, backend=backend)
            self._wrappers[key] = w
        return w

    def heads(self) -> tuple[int, int, int, int]:
        """``(Hq, Hkv, D, P)``: the shape arguments of every wrapper ``plan``."""
        cfg = self.config
        return cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size

    def plan_kwargs(self) -> dict:
        """The keyword arguments of every wrapper ``plan`` (numerics of this config)."""
        cfg = self.config
        return dict(
            pos_encoding_mode="NONE",
            window_left=cfg.window_left,
            logits_soft_cap=cfg.logits_soft_cap,
            q_data_type=cfg.dtype,
            kv_data_type=cfg.kv_dtype,
            sm_scale=cfg.scale,
        )

    def plan(self, plan: Plan, static=None) -> None:
        """Plan the one wrapper this forward needs (``plan.state``, a :class:`FlashInferState`)."""
        heads, common = self.heads(), self.plan_kwargs()
        if plan.mode == ForwardMode.DECODE:
            w = self._wrapper("decode", "auto")
            # host indptr / last_page_len: FlashInfer schedules on the CPU, no device->host sync
            w.plan(plan.kv_indptr_cpu, plan.kv_indices, plan.kv_last_page_len_cpu, *heads, **common)
            backend = "decode-tc"
        elif plan.mask is not None:
            backend = "fa2"  # FlashInfer's fa3 template has no custom mask
            w = self._wrapper("prefill", backend)
            # device indptrs: FlashInfer computes the mask offsets and packs bits on the mask's device
            w.plan(
                plan.qo_indptr,
                plan.kv_indptr,
                plan.kv_indices,
                plan.kv_last_page_len,
                *heads,
                custom_mask=plan.mask.view(torch.bool),
                causal=False,
                **common,
            )
        else:
            knob = FlashInferOptions.of(plan.options).prefill_backend
            backend = self.resolve_backend(knob) if knob is not None else self.default_backend
            w = self._wrapper("prefill", backend)
            w.plan(
                plan.qo_indptr_cpu,
                plan.kv_indptr_cpu,
                plan.kv_indices,
                plan.kv_last_page_len_cpu,
                *heads,
                causal=plan.causal,
                **common,
            )
        plan.state = FlashInferState(w, backend, self.q_buffer(plan.num_tokens))

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
        q_scale=None,
        host_scales: tuple[float, float] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """``q [T, Hq, D]``, caches in ``config.kv_layout`` -> ``out [T, Hq, D]`` (+ natural-log ``lse [T, Hq]``).
        fp8 KV: ``k_scale`` / ``v_scale`` one-element float32 device tensors, or ``host_scales``
        ``(k, v)`` floats, which FlashInfer folds itself (see the module docstring). ``sinks``:
        :meth:`run_folded` (the paged wrappers this provider drives take no sink input)."""
        if sinks is not None:
            return self.run_folded(
                plan, q, k_cache, v_cache, out, lse, sinks, k_scale=k_scale, v_scale=v_scale, host_scales=host_scales
            )
        st: FlashInferState = plan.state
        fold = {}  # the host floats FlashInfer folds itself
        on_device = st.q_buf is not None and host_scales is None
        if st.q_buf is not None and host_scales is not None:
            fold = dict(k_scale=host_scales[0], v_scale=host_scales[1])
        elif on_device:  # 1-element views: the products are computed in float32, then rounded
            q = torch.mul(q, k_scale.reshape(1), out=st.q_buf[: q.shape[0]])
        st.wrapper.run(q, (k_cache, v_cache), out=out, lse=lse, return_lse=lse is not None, **fold)
        if on_device:
            out.mul_(v_scale.reshape(1))
        if lse is not None:
            lse.mul_(LN2)  # log2 -> natural log, in place

    def merge_state(self, v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
        """Merge two partial attentions over disjoint KV sets (split-KV / cascade) with FlashInfer's kernel.

        Args:
            v_a, v_b: ``[T, H, D]`` partial outputs; s_a, s_b: ``[T, H]`` float32 natural-log LSE.

        Returns:
            ``(v [T, H, D], s [T, H])``, ``s`` in natural log (converted to/from FlashInfer's log2).
        """
        v, s = self._fi.merge_state(v_a, s_a * LOG2E, v_b, s_b * LOG2E)
        return v, s.mul_(LN2)


class FlashInferRagged(RaggedKernel):
    """``BatchPrefillWithRaggedKVCacheWrapper`` (FlashInfer's cache-free prefill, SGLang's MLA prefill):
    head dims of :data:`HEAD_DIMS` with ``Dv = D``, or DeepSeek's 192 / 128; planned on the host lengths
    once per forward. The wrappers run one after another on one stream, so they share one workspace a device."""

    LIBRARY, HEAD_DIMS, DIM_PAIRS = "FlashInfer", HEAD_DIMS, ((192, 128),)
    _WORKSPACES: ClassVar[dict[torch.device, torch.Tensor]] = {}  # one a device, shared by every instance

    def __init__(self, config, device: torch.device):
        super().__init__(config, device)
        fi = _import_flashinfer()
        workspace = self._WORKSPACES.get(device)
        if workspace is None:  # allocated by the first (startup) instance, before the engine sizes its KV pool
            workspace = self._WORKSPACES[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")

    def plan(self, plan) -> None:
        c = self.config
        self._wrapper.plan(
            torch.from_numpy(plan.qo_indptr),
            torch.from_numpy(plan.kv_indptr),
            c.num_qo_heads,
            c.num_kv_heads,
            c.head_dim,
            head_dim_vo=c.head_dim_v,
            causal=plan.causal,
            sm_scale=c.scale,
            q_data_type=c.dtype,
            kv_data_type=c.dtype,
        )

    def run(self, plan, q, k, v, out) -> None:
        self._wrapper.run(q, k, v, out=out)
