"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2) in the core: MQA over one latent KV head.

Each token stores one latent row ``[kv_lora_rank R + rope dim Dr]`` (512 + 64) per layer, shared by every
query head. With the up-projections absorbed (``q_nope @ W_UK`` into the query, ``W_UV`` after the output),
attention is MQA with one KV head: qk head dim ``R + Dr``, value head dim ``R``, V = the first ``R`` columns
of the same cache. The core runs it as an :class:`~attnplug.core.config.AttentionConfig` with
``num_kv_heads=1, head_dim=R+Dr, head_dim_v=R`` (:func:`mla_config`): plans, page tables, CUDA graphs,
drafts and cascade are the GQA ones.

    cfg = mla_config(num_heads=16, page_size=64, sm_scale=s)
    k_cache, v_cache = latent_cache_views(cache, cfg)      # cache [pages, P, R + Dr]
    write_latent(kv_c, k_pe, cache, slot_mapping)            # [T, R], [T, Dr]
    attn = PagedAttention(cfg, provider="triton"); attn.plan(batch)
    out = attn.run(q, k_cache, v_cache)                      # q [T, H, R + Dr] -> out [T, H, R]
"""

from __future__ import annotations

import math

import torch

from .config import AttentionConfig, UnsupportedFeature
from .plan import Plan


def mla_config(
    num_heads: int,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    page_size: int = 64,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
) -> AttentionConfig:
    """The core config of one MLA layer family: ``num_heads`` query heads (per GPU) over one latent head.
    ``sm_scale``: the model's softmax scale (DeepSeek: ``mscale**2 / sqrt(qk_nope + qk_rope)``; ``None``:
    ``1/sqrt(R + Dr)``). ``kv_dtype``: an fp8 latent cache (one scale, ``k_scale``) where the provider
    reads it."""
    return AttentionConfig(
        num_qo_heads=num_heads,
        num_kv_heads=1,
        head_dim=kv_lora_rank + qk_rope_head_dim,
        page_size=page_size,
        dtype=dtype,
        kv_layout="NHD",
        sm_scale=sm_scale,
        kv_dtype=kv_dtype,
        head_dim_v=kv_lora_rank,
    )


def _require_mla(config: AttentionConfig) -> None:
    if not config.is_mla:
        raise ValueError("attnplug: not an MLA config (head_dim_v == head_dim); build one with mla_config()")


def latent_cache_views(cache: torch.Tensor, config: AttentionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache)`` for ``PagedAttention.run``: ``cache [pages, P, R + Dr]`` (or ``[pages, P, 1,
    R + Dr]``) as ``k [pages, P, 1, R + Dr]`` and its first ``R`` columns ``v [pages, P, 1, R]`` (views)."""
    _require_mla(config)
    if cache.dim() == 3:
        cache = cache.unsqueeze(2)
    if cache.dim() != 4 or tuple(cache.shape[1:]) != (config.page_size, 1, config.head_dim):
        raise ValueError(
            f"attnplug: the MLA latent cache must be [num_pages, {config.page_size}, "
            f"{config.head_dim}] (or with a head dim of 1), got {list(cache.shape)}"
        )
    return cache, cache[..., : config.head_dim_v]


def check_latent_views(config: AttentionConfig, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """``ValueError`` unless ``v_cache`` is the first ``head_dim_v`` columns of ``k_cache``
    (:func:`latent_cache_views`): the kernels read V from the latent rows they read K from."""
    want = (k_cache.shape[0], config.page_size, 1, config.head_dim_v)
    if (
        tuple(v_cache.shape) != want
        or v_cache.data_ptr() != k_cache.data_ptr()
        or v_cache.stride() != k_cache.stride()
        or k_cache.stride(-1) != 1
    ):
        raise ValueError(
            f"attnplug: MLA v_cache must be k_cache[..., :{config.head_dim_v}] "
            "(latent_cache_views), "
            f"got shape {list(v_cache.shape)} strides {v_cache.stride()} vs k_cache strides "
            f"{k_cache.stride()}"
        )


def write_latent(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> None:
    """``cache[slot // P, slot % P] = cat(kv_c[t], k_pe[t])`` for every ``t`` with ``slot_mapping[t] >= 0``.

    ``kv_c [>= T, R]``, ``k_pe [>= T, Dr]`` (any row stride, last dim contiguous; e.g. ``k_pe [T, 1, Dr]``
    squeezed), ``cache [pages, P, R + Dr]`` or ``[pages, P, 1, R + Dr]``, ``slot_mapping [T]`` int32/int64.
    fp8 cache: ``value / k_scale`` saturated and rounded (``k_scale`` a one-element float32 device tensor).
    One Triton launch, no sync, no allocation: capturable."""
    from .kernels.mla import write_latent_paged  # noqa: PLC0415 - triton only where MLA runs

    write_latent_paged(kv_c, k_pe, cache, slot_mapping, k_scale)


def check_mla_support(provider: str, config: AttentionConfig) -> None:
    """Raise :class:`~attnplug.core.config.UnsupportedFeature` (naming attnplug, the provider and the
    feature) when provider ``provider`` cannot serve the MLA ``config``; no device needed (startup checks)."""
    from .registry import get_provider_cls  # noqa: PLC0415

    _require_mla(config)
    cls = get_provider_cls(provider).mla_class()
    if cls is None:
        raise UnsupportedFeature(f"attnplug: provider '{provider}' does not support MLA (multi-head latent attention)")
    refusal = cls.mla_refusal(config) or cls.kv_dtype_refusal(config)
    if refusal:  # the words the provider's constructor uses
        raise UnsupportedFeature(f"attnplug: provider '{provider}' does not support {refusal}")


def library_refusal(config: AttentionConfig, library: str) -> str | None:
    """What of the MLA ``config`` a library's DeepSeek-shaped MLA kernels (16-bit, latent 512 + rope 64:
    FlashInfer's MLA wrapper, FA3's ``qv`` path) cannot compute, for ``Provider.mla_refusal``; ``None``:
    all."""
    if config.dtype not in (torch.float16, torch.bfloat16):
        return f"MLA in {config.dtype} ({library} runs float16/bfloat16)"
    if (config.kv_lora_rank, config.rope_dim) != (512, 64):
        return (
            f"MLA with kv_lora_rank {config.kv_lora_rank} + rope dim {config.rope_dim} ({library}'s MLA "
            "kernels: 512 + 64)"
        )
    return None


def mla_reference(
    plan: Plan,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Float32 MLA WITHOUT absorption (the oracle of the absorbed kernels): per head, keys
    ``cat(c @ w_uk[h], k_pe)``, values ``c @ w_uv[h]`` from the latent ``c`` and rope part ``k_pe`` of
    ``cache [pages, P, R + Dr]`` (times ``k_scale``), masks as :func:`~attnplug.core.reference.request_mask`.

    ``q_nope [T, H, Dn]``, ``q_pe [T, H, Dr]``, ``w_uk [H, R, Dn]``, ``w_uv [H, R, Dv]``. Returns
    ``[T, H, Dv]`` float32 (a query without keys: 0)."""
    from .reference import request_mask  # noqa: PLC0415

    cfg = plan.config
    R = cfg.head_dim_v
    H, Dv = w_uv.shape[0], w_uv.shape[2]
    out = torch.zeros(q_nope.shape[0], H, Dv, dtype=torch.float32, device=q_nope.device)
    flat = cache.reshape(cache.shape[0] * cfg.page_size, cfg.head_dim).float() * k_scale
    qo, kvp, kv_lens = plan.qo_indptr_cpu.tolist(), plan.kv_indptr_cpu.tolist(), plan.kv_lens_cpu.tolist()
    for b in range(plan.batch_size):
        q0, q1, kv_len = qo[b], qo[b + 1], kv_lens[b]
        if q1 == q0:
            continue
        pages = plan.kv_indices_cpu[kvp[b] : kvp[b + 1]].long()
        slots = (pages[:, None] * cfg.page_size + torch.arange(cfg.page_size)).reshape(-1)[:kv_len]
        rows = flat[slots.to(flat.device)]  # [kv, R + Dr]
        c, pe = rows[:, :R], rows[:, R:]
        k_nope = torch.einsum("kr,hrn->hkn", c, w_uk.float())  # [H, kv, Dn]
        v = torch.einsum("kr,hrv->hkv", c, w_uv.float())  # [H, kv, Dv]
        s = (
            torch.einsum("qhn,hkn->hqk", q_nope[q0:q1].float(), k_nope)
            + torch.einsum("qhd,kd->hqk", q_pe[q0:q1].float(), pe)
        ) * cfg.scale
        m = request_mask(plan, b, q1 - q0, kv_len, q_nope.device)
        s = s.masked_fill(~m[None], -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,hkv->qhv", p, v)
    return out


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The absorbed query ``[T, H, R + Dr]`` in ``dtype``: ``cat(q_nope[h] @ w_uk[h]^T, q_pe)``
    (``w_uk [H, R, Dn]``)."""
    q_lat = torch.einsum("thn,hrn->thr", q_nope.float(), w_uk.float())
    return torch.cat([q_lat, q_pe.float()], dim=-1).to(dtype).contiguous()


__all__ = [
    "absorb_query",
    "check_latent_views",
    "check_mla_support",
    "latent_cache_views",
    "library_refusal",
    "mla_config",
    "mla_reference",
    "write_latent",
]
