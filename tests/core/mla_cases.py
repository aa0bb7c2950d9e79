"""Random MLA batches: a latent paged cache, per-head up-projections and the absorbed query."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from batches import random_case

from attnplug.core import ForwardMode
from attnplug.core.mla import absorb_query, latent_cache_views, mla_config, mla_reference
from attnplug.core.plan import Plan, make_plan


@dataclass
class MLACase:
    plan: Plan
    q: torch.Tensor  # [T, H, R + Dr] absorbed
    cache: torch.Tensor  # [pages, P, R + Dr]
    k_cache: torch.Tensor  # [pages, P, 1, R + Dr]
    v_cache: torch.Tensor  # [pages, P, 1, R]
    q_nope: torch.Tensor  # [T, H, Dn] float32 (before absorption)
    q_pe: torch.Tensor  # [T, H, Dr] float32
    w_uk: torch.Tensor  # [H, R, Dn]
    w_uv: torch.Tensor  # [H, R, Dv]
    ref: torch.Tensor  # [T, H, Dv] float32, computed without absorption

    def up(self, out_latent: torch.Tensor) -> torch.Tensor:
        """``[T, H, R]`` latent output -> ``[T, H, Dv]`` float32 (the adapter's W_UV)."""
        return torch.einsum("thr,hrv->thv", out_latent.float(), self.w_uv.float())


def mla_case(
    mode: ForwardMode,
    q_lens: list[int],
    prefix_lens: list[int],
    heads: int = 4,
    rank: int = 64,
    rope: int = 16,
    nope: int = 32,
    page_size: int = 16,
    dtype=torch.bfloat16,
    kv_dtype=None,
    seed: int = 0,
    mask_kind: str = "tree",
    device="cpu",
    k_scale: float = 1.0,
) -> MLACase:
    """A random ragged MLA batch (random page table) and its unabsorbed float32 reference."""
    cfg = mla_config(
        heads, rank, rope, page_size=page_size, sm_scale=(nope + rope) ** -0.5, dtype=dtype, kv_dtype=kv_dtype
    )
    base = random_case(
        mode,
        q_lens,
        prefix_lens,
        mla_config(heads, rank, rope, page_size=page_size, dtype=dtype),
        seed=seed,
        mask_kind=mask_kind,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    cache = base.k_cache.squeeze(2)
    if kv_dtype is not None and kv_dtype != dtype:
        cache = (cache.float() / k_scale).to(kv_dtype)
    T = sum(q_lens)
    w_uk = torch.randn(heads, rank, nope, generator=gen) * rank**-0.5
    w_uv = torch.randn(heads, rank, nope, generator=gen) * rank**-0.5
    q_nope = torch.randn(T, heads, nope, generator=gen)
    q_pe = torch.randn(T, heads, rope, generator=gen)
    plan = make_plan(cfg, base.batch, num_pages=base.num_pages, device="cpu")
    q = absorb_query(q_nope, q_pe, w_uk, dtype)
    # the reference (float32, on ``device``) reads the latent cache exactly as stored
    dev = torch.device(device)
    ref = mla_reference(plan, q_nope.to(dev), q_pe.to(dev), cache.to(dev), w_uk.to(dev), w_uv.to(dev), k_scale=k_scale)
    k_cache, v_cache = latent_cache_views(cache.to(dev), cfg)
    if dev.type != "cpu":
        plan = make_plan(cfg, base.batch, num_pages=base.num_pages, device=dev)
    return MLACase(plan, q.to(dev), cache.to(dev), k_cache, v_cache, q_nope, q_pe, w_uk, w_uv.to(dev), ref.to(dev))
