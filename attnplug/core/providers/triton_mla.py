"""The ``triton`` provider's MLA class: absorbed attention over the latent cache
(:mod:`attnplug.core.kernels.mla`).

Constructing :class:`~attnplug.core.providers.triton.TritonProvider` with an MLA config yields this class.
One kernel serves every mode (decode, chain / tree verify, extend, the cascade's non-causal prefix parts);
split-KV where the programs do not fill the GPU, merged by the core's split merge. Graphs, drafts and cascade
as for GQA (its static memory holds the tile list and the split partials). fp8 latent caches: dequantized
on load with ``k_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import AttentionConfig
from ..pages import num_pages
from ..plan import Plan
from .base import Provider
from .triton import TritonOptions, TritonProvider, TritonStatic, _next_pow2, _tiling


@dataclass
class MLAState:
    """Per-forward launch arguments of the MLA kernel (``plan.state``)."""

    tile_req: torch.Tensor  # [num_tiles] int32
    tile_qstart: torch.Tensor  # [num_tiles] int32
    num_tiles: int
    num_splits: int
    block_q: int
    block_h: int
    block_m: int  # block_q * block_h (the cascade graph's probe reads it)
    block_n: int
    num_warps: int
    num_stages: int
    partial: torch.Tensor | None  # [T, H, S, R] float32 when split
    partial_lse: torch.Tensor | None  # [T, H, S] float32 base-2 when split
    kv_start: torch.Tensor | None


class TritonMLAProvider(TritonProvider):
    """attnplug's Triton kernels for MLA configs (``config.is_mla``)."""

    IS_MLA = True
    Options = TritonOptions  # the same knobs as the triton provider

    @classmethod
    def mla_refusal(cls, config: AttentionConfig) -> str | None:
        if config.kv_lora_rank > 1024 or config.rope_dim > 128:
            return f"MLA with kv_lora_rank {config.kv_lora_rank} / rope dim {config.rope_dim} (max 1024 / 128)"
        if config.kv_lora_rank < 16 or config.rope_dim < 1:
            return f"MLA with kv_lora_rank {config.kv_lora_rank} / rope dim {config.rope_dim} (min 16 / 1)"
        return None

    def check_config(self, config: AttentionConfig) -> None:
        from .triton import _num_sms  # noqa: PLC0415

        self._sms = _num_sms(self.device)
        self._pdl_ok = False
        self._entry_keys = {}

    # -- tiles ------------------------------------------------------------------------------------
    def _mla_tiles(self, max_q_len: int) -> tuple[int, int, int, int, int]:
        """(block_q, block_h, block_n, num_warps, num_stages): decode rows are heads (up to 64 a program);
        multi-token tiles take 64 rows of ``block_q`` tokens x ``block_h`` heads. Decode of a large latent with
        64 heads a program: 64-key blocks, 8 warps, 3 stages (``probes/mla_sweep.py``, docs/mla.md)."""
        cfg = self.config
        big = cfg.kv_lora_rank > 128
        bh = max(16, min(_next_pow2(cfg.num_qo_heads), 64 if max_q_len <= 1 else 16))
        bq = 1 if max_q_len <= 1 else max(1, 64 // bh)
        if big and max_q_len <= 1 and bh == 64:
            return bq, bh, 64, 8, 3
        return bq, bh, 32 if big else 64, 8 if big else 4, 2

    def split_count(self, num_tiles: int, max_kv_len: int, forced: int | None = None, noncausal: bool = False) -> int:
        """``forced``, else 1 below 1024 keys or where ``num_tiles x head blocks`` programs fill the GPU. Else
        a small latent: enough splits for two programs an SM, at most one per 256 keys and 128 in all. A large
        latent (> 128): the fewest splits, a power of two (at most one per 512 keys, 128 in all), whose
        programs fill the fewest whole waves per split, a wave being one program an SM with 64 heads a program, two with
        fewer (the partials' merge favours fewer splits)."""
        if forced is not None:
            return max(1, int(forced))
        cfg = self.config
        bh = self._mla_tiles(1)[1]
        programs = max(1, num_tiles * num_pages(cfg.num_qo_heads, bh))
        if max_kv_len < 1024 or programs >= self._sms:
            return 1
        if cfg.kv_lora_rank <= 128:
            return max(1, min(128, max_kv_len // 256, num_pages(2 * self._sms, programs)))
        slots = self._sms * (1 if bh == 64 else 2)
        cap = max(1, min(128, max_kv_len // 512))
        twos = [1 << i for i in range(cap.bit_length())]
        return min(twos, key=lambda s: (num_pages(programs * s, slots) / s, s))

    def static_buffers(
        self,
        max_rows: int,
        max_tokens: int,
        max_kv_len: int,
        q: int = 1,
        num_kv_splits: int | None = None,
        noncausal: bool = False,
    ) -> TritonStatic:
        """Tiles for ``max_tokens`` rows and split partials ``[rows * q, H, S, R]`` for the largest split."""
        cfg, dev = self.config, self.device
        splits = (self.split_count(r, max_kv_len, num_kv_splits, noncausal) for r in range(1, max_rows + 1))
        n = max((r * q * s for r, s in enumerate(splits, 1) if s > 1), default=0) * cfg.num_qo_heads
        rows = max(max_tokens, max_rows)
        return TritonStatic(
            tile_req=torch.arange(rows, dtype=torch.int32, device=dev),
            tile_qstart=torch.zeros(rows, dtype=torch.int32, device=dev),
            partial=torch.empty(n * cfg.head_dim_v, dtype=torch.float32, device=dev),
            partial_lse=torch.empty(n, dtype=torch.float32, device=dev),
            identity_rows=max_rows,
        )

    # -- plan / run -------------------------------------------------------------------------------
    def plan(self, plan: Plan, static: TritonStatic | None = None) -> None:
        cfg, o = self.config, TritonOptions.of(plan.options)
        bq, bh, bn, warps, stages = self._mla_tiles(plan.max_q_len)
        if o.block_m is not None and plan.max_q_len > 1:
            bq = max(1, o.block_m // bh)
        elif o.block_m is not None:  # decode: the rows are heads
            bh = max(16, _next_pow2(o.block_m))
        bn, warps, stages = o.block_n or bn, o.num_warps or warps, o.num_stages or stages
        identity, counts, ends, num_tiles = _tiling(plan.q_lens_cpu.numpy(), bq)
        splits = self.split_count(num_tiles, plan.max_kv_len, o.num_kv_splits)
        tile_req, tile_q = self._place_tiles(plan, static, identity, num_tiles, counts, ends, bq, False)
        partial = partial_lse = None
        if splits > 1:
            shape = (plan.num_tokens, cfg.num_qo_heads, splits, cfg.head_dim_v)
            if static is not None:
                n = shape[0] * shape[1] * shape[2]
                if n > static.partial_lse.numel():
                    raise ValueError(
                        f"attnplug: {splits} splits of {plan.num_tokens} tokens exceed the static MLA split workspace"
                    )
                partial = static.partial[: n * shape[3]].view(shape)
                partial_lse = static.partial_lse[:n].view(shape[:3])
            else:
                partial = torch.empty(shape, dtype=torch.float32, device=self.device)
                partial_lse = torch.empty(shape[:3], dtype=torch.float32, device=self.device)
        plan.state = MLAState(
            tile_req=tile_req,
            tile_qstart=tile_q,
            num_tiles=num_tiles,
            num_splits=splits,
            block_q=bq,
            block_h=bh,
            block_m=bq * bh,
            block_n=bn,
            num_warps=warps,
            num_stages=stages,
            partial=partial,
            partial_lse=partial_lse,
            kv_start=o.kv_start,
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
        v_scale=None,
        q_scale=None,
        host_scales=None,
        sinks=None,
    ) -> None:
        """``q [T, H, R + Dr]`` over the latent ``k_cache [pages, P, 1, R + Dr]`` (``v_cache``: its first R
        columns, not read) -> ``out [T, H, R]``; ``lse [T, H]``."""
        from ..kernels.merge import merge_splits
        from ..kernels.mla import mla_attention_kernel

        a: MLAState = plan.state
        if a.num_tiles == 0:
            return
        cfg = self.config
        split = a.num_splits > 1
        if split:
            o, l = a.partial, a.partial_lse
            o_str = (o.stride(0), o.stride(1), o.stride(2))
            l_str = (l.stride(0), l.stride(1))
        else:
            o, l = out, (lse if lse is not None else out)
            o_str = (out.stride(0), out.stride(1), 0)
            l_str = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        fp8 = cfg.kv_quantized
        R = cfg.head_dim_v
        mla_attention_kernel[(a.num_tiles, num_pages(cfg.num_qo_heads, a.block_h), a.num_splits)](
            q,
            k_cache,
            o,
            l,
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_lens,
            a.tile_req,
            a.tile_qstart,
            plan.mask if plan.mask is not None else plan.kv_lens,
            plan.mask_indptr if plan.mask_indptr is not None else plan.kv_lens,
            a.kv_start if a.kv_start is not None else plan.kv_lens,
            k_scale if fp8 else plan.kv_lens,
            cfg.scale,
            a.num_splits,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            *o_str,
            *l_str,
            NUM_HEADS=cfg.num_qo_heads,
            R=R,
            DR=cfg.rope_dim,
            BLOCK_R=_next_pow2(R),
            BLOCK_DR=max(16, _next_pow2(cfg.rope_dim)),
            BLOCK_Q=a.block_q,
            BLOCK_H=a.block_h,
            BLOCK_N=a.block_n,
            PAGE_SIZE=cfg.page_size,
            CAUSAL=plan.causal and plan.mask is None,
            HAS_MASK=plan.mask is not None,
            HAS_KV_START=a.kv_start is not None,
            SPLIT=split,
            STORE_LSE=lse is not None,
            KV_FP8=fp8,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu",
            num_warps=a.num_warps,
            num_stages=a.num_stages,
        )
        if split:
            merge_splits(a.partial, a.partial_lse, out, lse)

    def run_merge(self, plan: Plan, q, k_cache, v_cache, out, lse, scratch_out, scratch_lse, **scales) -> None:
        """The contract's default: run into the scratch state, then the core's in-place merge."""
        Provider.run_merge(self, plan, q, k_cache, v_cache, out, lse, scratch_out, scratch_lse, **scales)


__all__ = ["TritonMLAProvider"]
