"""What the benchmark times: attnplug providers, the same libraries called directly, and PyTorch.

Each ``make_*`` takes a :class:`~attnplug.bench.workloads.Work` and returns ``fn`` (no arguments,
returns the ``[T, Hq, D]`` output; only kernel launches) or raises :class:`Unavailable` /
:class:`NotApplicable`. Host-side setup (plans, block tables, JIT) happens in ``make_*``.

fp8 rows (``row.kv == "fp8"``, e4m3 KV with per-layer scales): attnplug's providers get the scale
tensors and their floats (``host_scales``), as the engine adapters pass them; the libraries run their
own fp8 kernels as they are called directly: FlashInfer's fa2 templates with ``kv_data_type`` fp8 and
its host-float ``k_scale`` / ``v_scale``; FA3 with q quantized to e4m3 beforehand (untimed: the
engine's layer does it) and ``q/k/v_descale``; attnplug's own fp8 kernel through ``Provider.run`` (no
``PagedAttention`` layer) as the triton family's anchor.

``--cuda-graphs`` (``timing.graphed``): ``fn.graphed`` marks a replay already, ``fn.for_graphs()``
builds the capturable twin of an eager-only implementation, ``fn.not_capturable`` says why there is none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core import PagedAttention, ProviderUnavailable, UnsupportedFeature
from ..core.cuda_graph import GraphState
from ..core.providers import install_hint
from .workloads import Work


class Unavailable(Exception):
    """The library / provider cannot run here (reason in the message)."""


class NotApplicable(Exception):
    """The implementation does not compute this row's attention (e.g. no custom mask)."""


@dataclass(frozen=True)
class Impl:
    name: str  # row label, e.g. "attnplug.triton", "flashinfer.decode_tc", "torch.gather_sdpa"
    family: str  # --providers name: triton | flashinfer | fa3 | torch
    is_library: bool  # a library kernel called directly (the ratio's baseline)
    make: Callable[[Work], Callable[[], torch.Tensor]]


_WS: dict[torch.device, torch.Tensor] = {}


def _workspace(device) -> torch.Tensor:
    if device not in _WS:
        _WS[device] = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    return _WS[device]


# ---- attnplug providers -------------------------------------------------------------------
def _provider(name: str, cascade: str | None = None):
    """attnplug's ``name`` provider; ``cascade="off"``: shared-prefix rows without cascade (the
    default follows ``$ATTNPLUG_CASCADE``, i.e. the cost model)."""
    label = f"attnplug.{name}" + (".nocascade" if cascade == "off" else "")

    def make(work: Work):
        if cascade == "off" and not work.row.cascade_row:
            raise NotApplicable("cascade on/off is compared on the shared-prefix rows")
        try:
            attn = PagedAttention(work.config, name, work.q.device, cascade=cascade)
        except ProviderUnavailable as e:
            raise Unavailable(str(e)) from e
        except UnsupportedFeature as e:
            raise NotApplicable(str(e)) from e
        try:
            attn.plan(work.batch, num_pages=work.num_pages)  # first plan: JIT builds, caches
            t0 = time.perf_counter()
            plan = attn.plan(work.batch, num_pages=work.num_pages)
            work.extra[f"{label}.plan_ms"] = (time.perf_counter() - t0) * 1e3
            work.extra[f"{label}.cascade"] = plan.cascade is not None
        except UnsupportedFeature as e:
            raise NotApplicable(str(e)) from e
        q, k, v = work.q, work.k_cache, work.v_cache
        out = q.new_empty(*q.shape[:2], work.config.head_dim_v)  # MLA rows: the latent output
        scales = engine_scales(work)
        fn = lambda: attn.run(q, k, v, out=out, **scales)  # noqa: E731
        if not attn.provider.EAGER_RUN_CAPTURABLE:
            if work.row.kind == "decode":
                fn.for_graphs = lambda: _decode_graph_run(work, name)
            else:
                fn.not_capturable = f"the {name} provider's eager run (its graphs: decode rows, through GraphState)"
        return fn

    return make


def _decode_graph_run(work: Work, provider: str):
    """``provider``'s decode ``GraphState`` for the row's batch (updated on the host; cascade graphs off,
    the engines' default), uncaptured: what ``--cuda-graphs`` captures for a provider whose eager run is
    not capturable."""
    cfg, q, k, v = work.config, work.q, work.k_cache, work.v_cache
    B = work.batch.batch_size
    gs = GraphState(
        cfg,
        provider,
        max_batch=B,
        max_tokens=B,
        max_pages=work.num_pages,
        device=q.device,
        max_seq_len=work.block_table.shape[1] * cfg.page_size,
    )
    gs.prepare_capture(B)
    gs.update(work.batch, B)
    out, scales = q.new_empty(*q.shape[:2], cfg.head_dim_v), engine_scales(work)
    return lambda: gs.run(B, q, k, v, out, **scales)


def engine_scales(work: Work) -> dict:
    """fp8 rows: the scale arguments as the adapters pass them (the tensors, and their floats as
    ``host_scales``: both engines fix the scales at load); else none."""
    sc = dict(work.extra.get("scales", {}))
    if sc:
        sc["host_scales"] = work.extra["scale_floats"]
    return sc


def _graph(provider: str, cascade: str):
    """attnplug decode (``provider``: triton or fa3) as the engines replay it: a decode ``GraphState``
    of the row's batch size, updated from the device block table (one launch; with cascade, the
    shared-page search first), then the captured graph (CPU: the same launches, uncaptured).
    ``cascade``: the graph family's mode (``ATTNPLUG_CASCADE_GRAPHS=1`` in the engines)."""
    label = f"attnplug.{provider}.graph" + ("_cascade" if cascade != "off" else "")

    def make(work: Work):
        if work.row.kind != "decode" or not work.row.cascade_row:
            raise NotApplicable("decode graphs are compared on the shared-prefix rows and their unshared twins")
        cfg, q, k, v = work.config, work.q, work.k_cache, work.v_cache
        B, dev = work.batch.batch_size, q.device
        try:
            gs = GraphState(
                cfg,
                provider,
                max_batch=B,
                max_tokens=B,
                max_pages=work.num_pages,
                device=dev,
                max_seq_len=work.block_table.shape[1] * cfg.page_size,
                cascade=cascade,
            )
        except ProviderUnavailable as e:
            raise Unavailable(str(e)) from e
        gs.prepare_capture(B)
        gs.update_from_block_table(work.seq_lens, work.block_table, B)
        out, scales = torch.empty_like(q), engine_scales(work)
        if gs.cascade is not None:
            work.extra[f"{label}.shared_pages"] = int(gs.cascade.kv_lens.sum()) // cfg.page_size
        if dev.type != "cuda":
            return lambda: gs.run(B, q, k, v, out, **scales)
        gs.run(B, q, k, v, out, **scales)  # compile outside the capture
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gs.run(B, q, k, v, out, **scales)
        fn = lambda: g.replay() or out  # noqa: E731
        fn.graphed = True  # already a graph replay (``--cuda-graphs`` times it as it is)
        return fn

    return make


def _triton_kernel_fp8(work: Work):
    """attnplug's fp8 Triton kernel called directly (``TritonProvider.run`` on a plan, without the
    ``PagedAttention`` layer): the triton family's library anchor on fp8 rows."""
    if work.row.kv != "fp8":
        raise NotApplicable("the direct-kernel anchor runs on fp8 rows")
    try:
        attn = PagedAttention(work.config, "triton", work.q.device, cascade="off")
    except ProviderUnavailable as e:
        raise Unavailable(str(e)) from e
    plan = attn.plan(work.batch, num_pages=work.num_pages)
    prov, q, k, v = attn.provider, work.q, work.k_cache, work.v_cache
    out, sc = torch.empty_like(q), work.extra["scales"]
    ks, vs = sc["k_scale"], sc["v_scale"]
    return lambda: prov.run(plan, q, k, v, out, None, k_scale=ks, v_scale=vs) or out


# ---- FlashInfer called directly ----------------------------------------------------------------
def _flashinfer():
    try:
        import flashinfer  # noqa: PLC0415
    except Exception as e:
        raise Unavailable(f"flashinfer is unavailable ({e!r}); to install: {install_hint('flashinfer')}") from e
    return flashinfer


def _fi_common(work: Work) -> dict:
    c = work.config
    return dict(q_data_type=c.dtype, kv_data_type=c.kv_dtype, sm_scale=c.scale)


def _fi_scales(work: Work) -> dict:
    """fp8 rows: FlashInfer's own scale arguments (host floats) to ``run``; else none."""
    if work.row.kv != "fp8":
        return {}
    ks, vs = work.extra["scale_floats"]
    return dict(k_scale=ks, v_scale=vs)


def _fi_eager(fn):
    """``fn`` runs a FlashInfer wrapper built with ``use_cuda_graph=False``: not capturable as it is."""
    fn.not_capturable = "a FlashInfer wrapper built without use_cuda_graph"
    return fn


def _fi_decode(work: Work):
    if work.row.kind != "decode":
        raise NotApplicable("decode kernel")
    fi, c, b = _flashinfer(), work.config, work.batch
    from ..core.providers.flashinfer import fa2_decode_kwargs  # noqa: PLC0415

    extra = fa2_decode_kwargs(fi) if work.row.kv == "fp8" else {}  # bf16 q + fp8 KV: the fa2 template
    dev = work.q.device
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(dev), c.kv_layout, use_tensor_cores=True, **extra)
    w.plan(
        b.kv_indptr,
        b.kv_indices.to(dev),
        b.kv_last_page_len,
        c.num_qo_heads,
        c.num_kv_heads,
        c.head_dim,
        c.page_size,
        **_fi_common(work),
    )
    q, kv, sc = work.q, (work.k_cache, work.v_cache), _fi_scales(work)

    def for_graphs():
        """The same decode on a ``use_cuda_graph=True`` wrapper (fixed page-table buffers), as the engines
        capture it."""
        wg = fi.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(dev),
            c.kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=b.kv_indptr.to(dev),
            paged_kv_indices_buffer=b.kv_indices.to(dev),
            paged_kv_last_page_len_buffer=b.kv_last_page_len.to(dev),
            **extra,
        )
        wg.plan(
            b.kv_indptr,
            b.kv_indices,
            b.kv_last_page_len,
            c.num_qo_heads,
            c.num_kv_heads,
            c.head_dim,
            c.page_size,
            **_fi_common(work),
        )
        out = torch.empty_like(q)
        return lambda: wg.run(q, kv, out=out, **sc)

    fn = lambda: w.run(q, kv, **sc)  # noqa: E731
    fn.for_graphs = for_graphs
    return fn


def _fi_prefill(backend: str):
    def make(work: Work):
        if work.row.kind == "decode":
            raise NotApplicable("prefill kernel")
        fi, c, b = _flashinfer(), work.config, work.batch
        if work.row.kind == "verify" and backend != "fa2":
            raise NotApplicable(f"FlashInfer's {backend} template has no custom mask")
        if backend == "fa3" and torch.cuda.get_device_capability(work.q.device)[0] != 9:
            raise Unavailable("fa3 template needs sm90")
        if backend == "fa3" and work.row.kv == "fp8":
            raise NotApplicable("FlashInfer's fa3 template reads fp8 KV only with an fp8 query")
        dev = work.q.device
        w = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(dev), c.kv_layout, backend=backend)
        if work.row.kind == "verify":
            w.plan(
                b.qo_indptr.to(dev),
                b.kv_indptr.to(dev),
                b.kv_indices.to(dev),
                b.kv_last_page_len.to(dev),
                c.num_qo_heads,
                c.num_kv_heads,
                c.head_dim,
                c.page_size,
                custom_mask=b.custom_mask.to(dev),
                causal=False,
                **_fi_common(work),
            )
        else:
            w.plan(
                b.qo_indptr,
                b.kv_indptr,
                b.kv_indices.to(dev),
                b.kv_last_page_len,
                c.num_qo_heads,
                c.num_kv_heads,
                c.head_dim,
                c.page_size,
                causal=True,
                **_fi_common(work),
            )
        q, kv, sc = work.q, (work.k_cache, work.v_cache), _fi_scales(work)
        return _fi_eager(lambda: w.run(q, kv, **sc))

    return make


def _fi_cascade(work: Work):
    """FlashInfer's ``MultiLevelCascadeAttentionWrapper``: level 0 = every query over the shared pages,
    level 1 = each request over its own pages (FlashInfer's documented cascade layout)."""
    r, c, b = work.row, work.config, work.batch
    if not r.shared:
        raise NotApplicable("cascade wrapper: shared-prefix rows")
    fi, dev, P = _flashinfer(), work.q.device, c.page_size
    S = r.shared // P
    ind, idx = b.kv_indptr.long(), b.kv_indices
    keep = torch.arange(idx.numel()) - torch.repeat_interleave(ind[:-1], ind[1:] - ind[:-1]) >= S
    i32 = dict(dtype=torch.int32, device=dev)
    qo = [torch.tensor([0, r.batch * r.q_len], **i32), b.qo_indptr.to(dev)]
    kv_indptr = [torch.tensor([0, S], **i32), (ind - torch.arange(r.batch + 1) * S).to(**i32)]
    kv_indices = [idx[:S].to(dev), idx[keep].to(dev)]
    last = [torch.tensor([P], **i32), b.kv_last_page_len.to(dev)]
    w = fi.MultiLevelCascadeAttentionWrapper(2, _workspace(dev), c.kv_layout)
    w.plan(
        qo, kv_indptr, kv_indices, last, c.num_qo_heads, c.num_kv_heads, c.head_dim, P, causal=True, **_fi_common(work)
    )
    q, kv = work.q, (work.k_cache, work.v_cache)
    return _fi_eager(lambda: w.run(q, kv))


# ---- FA3 called directly -------------------------------------------------------------------------
def fa3_lib(work: Work):
    """The loaded FA3 build (:func:`~attnplug.core.providers.fa3.load_fa3`); :class:`Unavailable` without
    one or off sm90."""
    from ..core.providers.base import ProviderUnavailable as PU  # noqa: PLC0415
    from ..core.providers.fa3 import load_fa3  # noqa: PLC0415

    try:
        lib = load_fa3()
    except PU as e:
        raise Unavailable(str(e)) from e
    if torch.cuda.get_device_capability(work.q.device)[0] != 9:
        raise Unavailable("FA3 needs sm90")
    return lib


def _fa3_direct(work: Work):
    if work.row.kind == "verify":
        raise NotApplicable("FA3 has no custom (tree) mask")
    if work.config.kv_layout != "NHD":
        raise NotApplicable("FA3 needs NHD")
    lib = fa3_lib(work)
    r, c = work.row, work.config
    q, k, v = work.q, work.k_cache, work.v_cache
    cu_q = work.batch.qo_indptr.to(q.device)
    bt, sl = work.block_table, work.seq_lens
    kv_len = r.prefix + r.q_len
    fp8 = {}
    if r.kv == "fp8":  # FA3's fp8 kernel: q, k, v e4m3, per-(sequence, KV head) descales, bf16 out
        from ..core.kv_layout import quantize_fp8  # noqa: PLC0415

        shape = (r.batch, c.num_kv_heads)
        sc = work.extra["scales"]
        fp8 = dict(
            q_descale=torch.ones(shape, device=q.device),
            k_descale=sc["k_scale"].expand(shape),
            v_descale=sc["v_scale"].expand(shape),
        )
        q = quantize_fp8(q, 1.0, torch.float8_e4m3fn)  # the engine's layer quantizes q (untimed here)
    if lib.varlen_style:  # vLLM's flash_attn_varlen_func(..., block_table=, seqused_k=, fa_version=3)
        out = torch.empty(q.shape, dtype=c.dtype, device=q.device)
        return lambda: lib.fn(
            q,
            k,
            v,
            r.q_len,
            cu_q,
            kv_len,
            seqused_k=sl,
            softmax_scale=c.scale,
            causal=True,
            block_table=bt,
            out=out,
            fa_version=3,
            **fp8,
        )
    return lambda: lib.fn(
        q,
        k,
        v,
        cache_seqlens=sl,
        page_table=bt,
        cu_seqlens_q=cu_q,
        max_seqlen_q=r.q_len,
        softmax_scale=c.scale,
        causal=True,
        **fp8,
    )


# ---- PyTorch: gather the pages, then scaled_dot_product_attention ------------------------------
def _torch_sdpa(work: Work):
    r, c = work.row, work.config
    if c.kv_layout != "NHD":
        raise NotApplicable("bench's torch path gathers NHD pages")
    B, ql, kv_len = r.batch, r.q_len, r.prefix + r.q_len
    q, kc, vc, bt = work.q, work.k_cache, work.v_cache, work.block_table.long()
    ks, vs = work.extra["scale_floats"] if r.kv == "fp8" else (None, None)
    mask = None
    if work.tree is not None:
        mask = work.tree[:, None]  # [B, 1, q, kv]
    elif r.kind != "decode" and r.prefix > 0:
        mask = torch.ones(ql, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=r.prefix)
    is_causal = r.kind == "prefill" and r.prefix == 0

    def fn():
        k = kc[bt].reshape(B, -1, c.num_kv_heads, c.head_dim)[:, :kv_len].transpose(1, 2)
        v = vc[bt].reshape(B, -1, c.num_kv_heads, c.head_dim)[:, :kv_len].transpose(1, 2)
        if ks is not None:  # fp8: dequantize the gathered pages
            k, v = k.to(q.dtype) * ks, v.to(q.dtype) * vs
        qq = q.view(B, ql, c.num_qo_heads, c.head_dim).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, k, v, attn_mask=mask, is_causal=is_causal, scale=c.scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(-1, c.num_qo_heads, c.head_dim)

    return fn


def _gqa(make):
    """``make`` for the GQA rows only: the MLA rows have their own library calls (:mod:`.mla`)."""

    def gqa_only(work: Work):
        if work.config.is_mla:
            raise NotApplicable("MLA rows: the library's MLA kernel is measured instead")
        return make(work)

    return gqa_only


def _mla_impls() -> list[Impl]:
    from . import mla  # noqa: PLC0415

    return [
        Impl("flashinfer.mla", "flashinfer", True, mla._fi_mla),
        Impl("fa3.mla_qv", "fa3", True, mla._fa3_mla),
        Impl("fa3.mla_prefill_mha", "fa3", True, mla._fa3_mla_prefill_mha),
        *(
            Impl(f"attnplug.{p}.mla_prefill_mha", p, False, mla.ragged_prefill(p))
            for p in ("triton", "flashinfer", "fa3")
        ),
        Impl("flashmla", "fa3", True, mla._flashmla),
    ]


IMPLS = [
    Impl("attnplug.triton", "triton", False, _provider("triton")),
    Impl("attnplug.flashinfer", "flashinfer", False, _provider("flashinfer")),
    Impl("attnplug.fa3", "fa3", False, _provider("fa3")),
    Impl("attnplug.triton.nocascade", "triton", False, _provider("triton", "off")),
    Impl("attnplug.flashinfer.nocascade", "flashinfer", False, _provider("flashinfer", "off")),
    Impl("attnplug.fa3.nocascade", "fa3", False, _provider("fa3", "off")),
    Impl("attnplug.triton.graph", "triton", False, _graph("triton", "off")),
    Impl("attnplug.triton.graph_cascade", "triton", False, _graph("triton", "auto")),
    Impl("attnplug.fa3.graph", "fa3", False, _graph("fa3", "off")),
    Impl("attnplug.fa3.graph_cascade", "fa3", False, _graph("fa3", "auto")),
    Impl("attnplug_kernel.triton_fp8", "triton", True, _gqa(_triton_kernel_fp8)),
    Impl("flashinfer.decode_tc", "flashinfer", True, _gqa(_fi_decode)),
    Impl("flashinfer.cascade", "flashinfer", True, _gqa(_fi_cascade)),
    Impl("flashinfer.prefill_fa3", "flashinfer", True, _gqa(_fi_prefill("fa3"))),
    Impl("flashinfer.prefill_fa2", "flashinfer", True, _gqa(_fi_prefill("fa2"))),
    Impl("fa3.paged", "fa3", True, _gqa(_fa3_direct)),
    Impl("torch.gather_sdpa", "torch", False, _gqa(_torch_sdpa)),
    *_mla_impls(),
]
FAMILIES = ("triton", "flashinfer", "fa3", "torch")
