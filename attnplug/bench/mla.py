"""MLA rows of the benchmark (issue 45): DeepSeek latent 512 + rope 64, page 64, bf16, 128 or 16 query heads.

attnplug's providers run the absorbed form through ``PagedAttention`` (``q [T, H, 576]`` over the latent
cache, ``out [T, H, 512]``). The library kernels measured beside them, called directly:

* ``flashinfer.mla``: FlashInfer's ``BatchMLAPagedAttentionWrapper`` (SGLang's flashinfer MLA backend);
* ``fa3.mla_qv``: FA3's paged call with ``q = q_pe``, ``k = k_pe``, ``v = c``, ``q_v = q_nope`` (vLLM's
  FLASH_ATTN_MLA);
* ``flashmla``: FlashMLA's ``flash_mla_with_kvcache`` (vLLM's FLASHMLA), decode rows, where the ``flash_mla``
  package is installed (the GPU bundles do not carry it: the row then says so);
* ``fa3.mla_prefill_mha`` (prefill rows): the engines' FA-based MLA prefill, FA3 varlen attention over the
  up-projected K / V (``k = cat(c @ W_UK, k_pe)`` [T, H, 192], ``v = c @ W_UV`` [T, H, 128]); the
  up-projection GEMMs are untimed (as attnplug's absorbed output's ``W_UV`` is); its output is checked
  against the reference's latent output times ``W_UV``; ``attnplug.<provider>.mla_prefill_mha``: the same
  through attnplug's ragged prefill (:mod:`attnplug.core.ragged`, SGLang's MLA prefill path).
"""

from __future__ import annotations

import torch

from ..core import BatchMetadata
from ..core.mla import absorb_query, latent_cache_views, mla_config
from .impls import NotApplicable, Unavailable, _flashinfer, _workspace, fa3_lib
from .workloads import Row, Work

RANK, ROPE, NOPE, PAGE = 512, 64, 128, 64


def mla_rows(quick: bool) -> list[Row]:
    """The MLA rows (``Row.mla = (heads, kv_lora_rank, rope dim)``)."""
    if quick:
        return [
            Row("MLA decode 4x100 h4", "decode", 4, 1, 99, mla=(4, 64, 16)),
            Row("MLA prefill 2x48 h4", "prefill", 2, 48, 0, mla=(4, 64, 16)),
        ]
    rows = []
    for h in (128, 16):
        rows += [
            Row(f"MLA decode 64x4096 h{h}", "decode", 64, 1, 4095, mla=(h, RANK, ROPE)),
            Row(f"MLA decode 1x32768 h{h}", "decode", 1, 1, 32767, mla=(h, RANK, ROPE)),
            Row(f"MLA prefill 4x4096 h{h}", "prefill", 4, 4096, 0, mla=(h, RANK, ROPE)),
        ]
    return rows


def build_mla(row: Row, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Work:
    """A random latent cache (random permuted page table), per-head ``W_UK`` / ``W_UV`` ``[H, R, 128]``, the
    un-absorbed query ``q_mha = cat(q_nope, q_pe)`` ``[T, H, 192]`` (``work.extra``: the FA prefill's
    inputs) and its absorbed form ``work.q [T, H, R + Dr]``."""
    h, rank, rope = row.mla
    page = PAGE if rank == RANK else 16
    cfg = mla_config(h, rank, rope, page_size=page, sm_scale=(NOPE + rope) ** -0.5, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    B, kv_len = row.batch, row.prefix + row.q_len
    per = -(-kv_len // page)
    n = B * per
    idx = torch.randperm(n, generator=gen).to(torch.int32)
    batch = BatchMetadata(
        row.mode,
        (torch.arange(B + 1) * row.q_len).to(torch.int32),
        (torch.arange(B + 1) * per).to(torch.int32),
        idx,
        torch.full((B,), (kv_len - 1) % page + 1, dtype=torch.int32),
    )
    torch.manual_seed(seed)
    cache = torch.randn(n, page, cfg.head_dim, dtype=dtype, device=device)
    k, v = latent_cache_views(cache, cfg)
    T = B * row.q_len
    w_uk = torch.randn(h, rank, NOPE, generator=gen).to(device) * rank**-0.5
    w_uv = torch.randn(h, rank, NOPE, generator=gen).to(device, dtype) * rank**-0.5
    q_nope = torch.randn(T, h, NOPE, device=device, dtype=dtype)
    q_pe = torch.randn(T, h, rope, device=device, dtype=dtype)
    q = absorb_query(q_nope, q_pe, w_uk, dtype)
    esz = cache.element_size()
    nbytes = (q.numel() + B * row.q_len * h * rank + B * kv_len * cfg.head_dim) * esz  # q, out, latents once
    keys = row.q_len * kv_len - row.q_len * (row.q_len - 1) / 2
    flops = 2.0 * h * (cfg.head_dim + rank) * keys * B
    work = Work(
        row,
        cfg,
        batch,
        q,
        k,
        v,
        n,
        idx.view(B, per).to(device),
        torch.full((B,), kv_len, dtype=torch.int32, device=device),
        None,
        nbytes,
        flops,
    )
    work.extra.update(w_uk=w_uk.to(dtype), w_uv=w_uv, q_mha=torch.cat([q_nope, q_pe], -1))
    return work


def up_projected(work: Work, ref: torch.Tensor) -> torch.Tensor:
    """The reference of an implementation that returns ``[T, H, 128]`` (the un-absorbed prefill): the
    latent reference ``ref [T, H, R]`` times ``W_UV``."""
    return torch.einsum("thr,hrv->thv", ref.float(), work.extra["w_uv"].float())


def _mla_only(work: Work, what: str) -> None:
    if not work.config.is_mla:
        raise NotApplicable(f"{what}: MLA rows")
    if (work.config.kv_lora_rank, work.config.rope_dim) != (RANK, ROPE):
        raise NotApplicable(f"{what}: the library kernels take the DeepSeek latent ({RANK} + {ROPE})")


def _fi_mla(work: Work):
    _mla_only(work, "FlashInfer's MLA wrapper")
    fi, c, b, dev = _flashinfer(), work.config, work.batch, work.q.device
    w = fi.BatchMLAPagedAttentionWrapper(_workspace(dev))
    kv_lens = torch.full((b.batch_size,), work.row.prefix + work.row.q_len, dtype=torch.int32)
    w.plan(
        b.qo_indptr,
        b.kv_indptr,
        b.kv_indices.to(dev),
        kv_lens,
        c.num_qo_heads,
        RANK,
        ROPE,
        c.page_size,
        work.row.kind != "decode",
        c.scale,
        c.dtype,
        c.kv_dtype,
    )
    q, lat = work.q, work.k_cache.squeeze(2)
    out = q.new_empty(*q.shape[:2], RANK)
    fn = lambda: w.run(q[..., :RANK], q[..., RANK:], lat[..., :RANK], lat[..., RANK:], out=out)  # noqa: E731
    fn.not_capturable = "a FlashInfer wrapper built without use_cuda_graph"
    return fn


def _fa3_mla(work: Work):
    _mla_only(work, "FA3's qv MLA path")
    lib, r, c = fa3_lib(work), work.row, work.config
    q, lat = work.q, work.k_cache
    cu_q = work.batch.qo_indptr.to(q.device)
    out = q.new_empty(*q.shape[:2], RANK)
    kw = dict(
        block_table=work.block_table,
        cu_seqlens_q=cu_q,
        seqused_k=work.seq_lens,
        max_seqlen_q=r.q_len,
        max_seqlen_k=r.prefix + r.q_len,
        causal=True,
        window=(-1, -1),
        softcap=0.0,
        scale=c.scale,
    )
    return lambda: (
        lib.paged(q[..., RANK:], lat[..., RANK:], lat[..., :RANK], out, return_lse=False, qv=q[..., :RANK], **kw) or out
    )


def _flashmla(work: Work):
    _mla_only(work, "FlashMLA")
    if work.row.kind != "decode":
        raise NotApplicable("FlashMLA: decode rows")
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata  # noqa: PLC0415
    except Exception as e:
        raise Unavailable(
            f"FlashMLA is not installed here ({e!r}): the GPU bundles carry neither the "
            "flash_mla package nor vLLM's _flashmla_C; pip install flash-mla (from its "
            "repository) to measure it"
        ) from e
    r, c = work.row, work.config
    q = work.q.view(r.batch, r.q_len, c.num_qo_heads, c.head_dim)
    md, splits = get_mla_metadata(work.seq_lens, r.q_len * c.num_qo_heads, 1)
    return lambda: flash_mla_with_kvcache(
        q, work.k_cache, work.block_table, work.seq_lens, RANK, md, splits, softmax_scale=c.scale, causal=True
    )[0].view(-1, c.num_qo_heads, RANK)


def _mha_inputs(work: Work) -> tuple:
    """The un-absorbed prefill's ``(q [T, H, 192], k [T, H, 192], v [T, H, 128], cu [B + 1])``: the latent
    rows in token order (the page table's), up-projected per head (untimed)."""
    _mla_only(work, "the un-absorbed MLA prefill")
    if work.row.kind != "prefill" or work.row.prefix:
        raise NotApplicable("the un-absorbed MLA prefill: prefill rows without a prefix")
    r, c = work.row, work.config
    B, L, dev = r.batch, r.q_len, work.q.device
    rows = work.k_cache.squeeze(2)[work.block_table.long()].reshape(B, -1, c.head_dim)[:, :L]
    rows = rows.reshape(B * L, -1)
    w_uk, w_uv = work.extra["w_uk"], work.extra["w_uv"]
    k_nope = torch.einsum("tr,hrn->thn", rows[:, :RANK], w_uk)
    k = torch.cat([k_nope, rows[:, None, RANK:].expand(-1, c.num_qo_heads, -1)], -1).contiguous()
    v = torch.einsum("tr,hrv->thv", rows[:, :RANK], w_uv).contiguous()
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * L
    return work.extra["q_mha"], k, v, cu  # q_mha: the query whose absorbed form is work.q


def _fa3_mla_prefill_mha(work: Work):
    """FA3 varlen over up-projected K / V (the engines' MLA prefill); output ``[T, H, 128]``."""
    lib, c = fa3_lib(work), work.config
    if not lib.varlen_style:
        raise Unavailable(f"the un-paged varlen call of vLLM's FA3 fork (loaded: {lib.source})")
    q, k, v, cu = _mha_inputs(work)
    L = work.row.q_len
    out = torch.empty(q.shape[0], c.num_qo_heads, NOPE, dtype=c.dtype, device=q.device)
    return lambda: lib.fn(q, k, v, L, cu, L, cu_seqlens_k=cu, softmax_scale=c.scale, causal=True, out=out, fa_version=3)


def ragged_prefill(provider: str):
    """``make`` of ``attnplug.<provider>.mla_prefill_mha``: the same un-absorbed prefill through attnplug's
    :class:`~attnplug.core.ragged.RaggedAttention` (SGLang's MLA prefill path); planned untimed."""

    def make(work: Work):
        from ..core import RaggedAttention, RaggedConfig  # noqa: PLC0415

        q, k, v, cu = _mha_inputs(work)
        c, h = work.config, work.config.num_qo_heads
        attn = RaggedAttention(RaggedConfig(h, h, q.shape[-1], NOPE, c.dtype, c.scale), provider, q.device)
        lens = [work.row.q_len] * work.row.batch
        attn.plan(lens, lens)
        out = torch.empty(q.shape[0], h, NOPE, dtype=c.dtype, device=q.device)
        return lambda: attn.run(q, k, v, out)

    return make
