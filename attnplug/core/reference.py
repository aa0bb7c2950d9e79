"""Float32 PyTorch reference of paged attention for every forward mode: the oracle of all tests.

Written for clarity, one request at a time; it is also the ``reference`` provider.
"""

from __future__ import annotations

import math

import torch

from .config import AttentionConfig
from .plan import Plan


def gather_kv(config: AttentionConfig, cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Gather one request's KV from the paged cache.

    Args:
        cache: ``[num_pages, P, Hkv, D]`` (NHD) or ``[num_pages, Hkv, P, D]`` (HND).
        pages: ``[n_pages]`` page ids of the request.
        kv_len: tokens to keep.

    Returns:
        ``[kv_len, Hkv, D]`` float32 (``D``: the cache's last dim).
    """
    blocks = cache[pages.long()].float()
    if config.kv_layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(-1, config.num_kv_heads, cache.shape[-1])[:kv_len]


def request_mask(plan: Plan, b: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, kv_len]`` bool: which keys each query of request ``b`` may see."""
    cfg = plan.config
    if plan.mask is not None:
        lo = int(plan.mask_indptr_cpu[b])
        m = plan.mask[lo : lo + q_len * kv_len].to(device=device, dtype=torch.bool).view(q_len, kv_len)
    else:
        m = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key = torch.arange(kv_len, device=device)[None, :]
    if plan.mask is None and plan.causal:
        m = m & (key <= pos)
    if cfg.window_left >= 0:
        m = m & (key >= pos - cfg.window_left)
    return m


def reference_attention(
    plan: Plan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float32 paged attention.

    Args:
        q: ``[num_tokens, Hq, D]``.
        k_cache, v_cache: paged caches in ``plan.config.kv_layout``.
        k_scale, v_scale: fp8 caches: keys = ``k_cache * k_scale`` (values alike; default 1), the
            float32 dequantized cache the attention runs on. Ignored for unquantized caches.
        sinks: ``[Hq]`` sink logits (attention sinks): each row's softmax runs over its visible logits
            and its head's sink, which has no value row (``lse`` includes it; a query without keys
            gets output 0 and lse ``sink``).

    Returns:
        ``(out [num_tokens, Hq, Dv] float32, lse [num_tokens, Hq] float32)`` (``Dv = head_dim_v``:
        MLA's latent output, with ``k_scale`` for the whole latent row); ``lse`` is the natural
        log-sum-exp of the scaled (and soft-capped) logits; a query that sees no key gets output 0
        and lse ``-inf``.
    """
    cfg = plan.config
    ks = float(k_scale) if cfg.kv_quantized and k_scale is not None else 1.0  # a host read: the oracle may sync
    vs = float(v_scale) if cfg.kv_quantized and v_scale is not None else 1.0
    if cfg.is_mla:  # one latent row, one scale: v_cache is its first head_dim_v columns
        vs = ks
    out = torch.zeros(q.shape[0], cfg.num_qo_heads, cfg.head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], cfg.num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    qo, kvp = plan.qo_indptr_cpu.tolist(), plan.kv_indptr_cpu.tolist()
    kv_lens = plan.kv_lens_cpu.tolist()
    for b in range(plan.batch_size):
        q0, q1 = qo[b], qo[b + 1]
        q_len, kv_len = q1 - q0, kv_lens[b]
        if q_len == 0:
            continue
        pages = plan.kv_indices_cpu[kvp[b] : kvp[b + 1]].to(k_cache.device)
        k = (gather_kv(cfg, k_cache, pages, kv_len) * ks).repeat_interleave(cfg.group_size, dim=1)
        v = (gather_kv(cfg, v_cache, pages, kv_len) * vs).repeat_interleave(cfg.group_size, dim=1)
        qb = q[q0:q1].float()  # [q_len, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qb, k) * cfg.scale
        if cfg.logits_soft_cap > 0:
            s = cfg.logits_soft_cap * torch.tanh(s / cfg.logits_soft_cap)
        m = request_mask(plan, b, q_len, kv_len, q.device)
        s = s.masked_fill(~m[None], -math.inf)
        if sinks is not None:  # one more logit per head, value 0
            sink_col = sinks.float().to(q.device)[:, None, None].expand(-1, q_len, 1)
            row_lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
        else:
            row_lse = torch.logsumexp(s, dim=-1)  # [Hq, q_len]
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return out, lse
