"""The ``triton`` provider: attnplug's own kernels (:mod:`attnplug.core.kernels`).

``plan`` picks block sizes and the split count, builds the tile list on the host once and keeps
the split workspace; ``run`` only launches (one kernel, plus the merge when split).
On a machine without CUDA it runs on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import AttentionConfig
from ..plan import Plan
from .base import Provider, ProviderUnavailable


@dataclass
class TritonArgs:
    """Per-forward launch arguments (built in ``plan``)."""

    tile_req: torch.Tensor  # [num_tiles] int32, request of each tile
    tile_qstart: torch.Tensor  # [num_tiles] int32, first query token of the tile within its request
    num_tiles: int
    num_splits: int
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    partial: torch.Tensor | None  # [T, Hq, S, D] float32 when split
    partial_lse: torch.Tensor | None  # [T, Hq, S] float32 (base-2) when split


def triton_interpreter_active() -> bool:
    """True when triton in this process runs interpreted (``TRITON_INTERPRET=1`` was set before triton
    was first imported; a later setting leaves triton's own library functions compiled)."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # another triton layout: trust the variable
        return os.environ.get("TRITON_INTERPRET") == "1"
    return isinstance(tl.standard.sigmoid, InterpretedFunction)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonProvider(Provider):
    name = "triton"

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        try:
            import triton  # noqa: F401
        except Exception as e:  # ImportError, or a broken install
            raise ProviderUnavailable(
                f"attnplug: provider 'triton' needs the triton package ({e}); pip install triton"
            ) from e
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ProviderUnavailable(
                "attnplug: provider 'triton' on CPU tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported"
            )
        if device.type == "cpu":
            import triton

            if not triton_interpreter_active():
                raise ProviderUnavailable(
                    "attnplug: provider 'triton' on CPU needs the Triton interpreter, but triton was imported "
                    "in compiled mode: TRITON_INTERPRET=1 must be set before anything imports triton"
                )
            if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
                raise ProviderUnavailable(
                    f"attnplug: provider 'triton' on CPU needs triton>=3.7 (its interpreter handles "
                    f"scalar loop bounds); found triton {triton.__version__}: pip install 'triton>=3.7'"
                )
        if device.type not in ("cpu", "cuda"):
            raise ProviderUnavailable(f"attnplug: provider 'triton' does not run on device {device}")

    def check_config(self, config: AttentionConfig) -> None:
        if config.head_dim > 256:
            raise self.unsupported(f"head_dim {config.head_dim} (max 256)")
        if config.head_dim < 16:
            raise self.unsupported(f"head_dim {config.head_dim} (min 16)")
        self._sms = _num_sms(self.device)

    # -- plan -------------------------------------------------------------------------------------
    def _blocks(self, plan: Plan) -> tuple[int, int, int, int, int]:
        """(block_q, block_m, block_n, num_warps, num_stages) for this batch.

        Defaults from the H200 sweep of 2026-11-29 (``benchmarks/sweep_triton.py``, Llama-3-8B
        shapes, d128; see benchmarks/NOTES.md); d > 128 halves the tiles to fit shared memory.
        """
        cfg = self.config
        g = cfg.group_size
        big_d = cfg.head_dim > 128
        if plan.max_q_len <= 1:  # decode: BLOCK_Q = 1, the GQA group fills the rows
            return 1, max(16, _next_pow2(g)), (64 if big_d else 128), 4, (2 if big_d else 3)
        block_m = max(64 if big_d else 128, _next_pow2(g))
        if plan.max_q_len * g < block_m:  # short queries (small verify trees / extends)
            block_m = max(16, _next_pow2(plan.max_q_len * g))
        block_q = max(1, block_m // g)
        if big_d:
            return block_q, block_m, 32, 4, 2
        if plan.mask is not None:  # verify: long mask-free prefix, wide KV blocks pay
            return block_q, block_m, 128, 8, 3
        return block_q, block_m, 32, 4, 3

    def _splits(self, plan: Plan, num_tiles: int, block_n: int) -> int:
        forced = plan.extra.get("num_kv_splits")
        if forced is not None:
            return max(1, int(forced))
        programs = num_tiles * self.config.num_kv_heads
        if programs >= self._sms or plan.max_kv_len < 1024:
            return 1
        by_len = plan.max_kv_len // 512
        target = (2 if programs >= 16 else 4) * self._sms  # tiny batches: oversubscribe harder
        return max(1, min(64, by_len, -(-target // max(programs, 1))))

    def plan(
        self,
        plan: Plan,
        *,
        tile_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        tiles_ready: bool = False,
        split_workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Tuning knobs in ``plan.extra`` (from ``PagedAttention.plan(**kw)``): ``num_kv_splits``,
        ``block_m``, ``block_n``, ``num_warps``, ``num_stages``; ``kv_start`` (``[B]`` int32 on the
        device): attend only to keys at positions ``>= kv_start[b]`` (the fa3 provider's tree part).

        Static buffers (CUDA graphs, multi-step draft; default: allocate per plan):
        ``tile_buffers = (tile_req, tile_qstart)``, flat int32 device tensors with room for every
        tile; the tile list is copied into their prefix. ``split_workspace = (partial, partial_lse)``,
        flat float32 device tensors of at least ``T*Hq*S*D`` / ``T*Hq*S`` elements; the split
        partials are views of them.
        """
        cfg = self.config
        block_q, block_m, block_n, warps, stages = self._blocks(plan)
        x = plan.extra
        block_m = x.get("block_m", block_m)
        block_q = max(1, block_m // cfg.group_size) if "block_m" in x else block_q
        block_n, warps, stages = x.get("block_n", block_n), x.get("num_warps", warps), x.get("num_stages", stages)
        q_lens = plan.q_lens_cpu.to(torch.int64)
        counts = (q_lens + block_q - 1) // block_q
        num_tiles = int(counts.sum())
        tile_req = torch.repeat_interleave(torch.arange(plan.batch_size), counts)
        first = torch.cumsum(counts, 0) - counts
        tile_q = (torch.arange(num_tiles) - torch.repeat_interleave(first, counts)) * block_q
        splits = self._splits(plan, num_tiles, block_n)
        if plan.max_q_len <= 1 and splits >= 32 and self.config.head_dim <= 128 and "block_n" not in x:
            block_n, warps, stages = 64, 2, 2  # many short splits: small tiles (H200 sweep, 1x32768)
        partial = partial_lse = None
        shape = (plan.num_tokens, cfg.num_qo_heads, splits, cfg.head_dim)
        if splits > 1 and split_workspace is not None:
            n = shape[0] * shape[1] * shape[2]
            partial, partial_lse = split_workspace[0][: n * shape[3]].view(shape), split_workspace[1][:n].view(shape[:3])
        elif splits > 1:
            partial = torch.empty(shape, dtype=torch.float32, device=self.device)
            partial_lse = torch.empty(shape[:3], dtype=torch.float32, device=self.device)
        tile_req, tile_q = tile_req.to(torch.int32), tile_q.to(torch.int32)
        if tile_buffers is not None:
            req_buf, q_buf = tile_buffers[0][:num_tiles], tile_buffers[1][:num_tiles]
            tile_req, tile_q = (req_buf, q_buf) if tiles_ready else (req_buf.copy_(tile_req), q_buf.copy_(tile_q))
        plan.extra["triton"] = TritonArgs(
            tile_req=tile_req.to(self.device),
            tile_qstart=tile_q.to(self.device),
            num_tiles=num_tiles,
            num_splits=splits,
            block_q=block_q,
            block_m=block_m,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            partial=partial,
            partial_lse=partial_lse,
        )

    # -- run --------------------------------------------------------------------------------------
    def run(self, plan: Plan, q, k_cache, v_cache, out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        from ..kernels.attention import paged_attention_kernel
        from ..kernels.merge import merge_splits

        a: TritonArgs = plan.extra["triton"]
        if a.num_tiles == 0:
            return
        cfg = self.config
        if cfg.kv_layout == "NHD":
            ks, vs = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)), (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        else:
            ks, vs = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1)), (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1))
        split = a.num_splits > 1
        if split:
            o, o_strides = a.partial, (a.partial.stride(0), a.partial.stride(1), a.partial.stride(2))
            l, l_strides = a.partial_lse, (a.partial_lse.stride(0), a.partial_lse.stride(1))
        else:
            o, o_strides = out, (out.stride(0), out.stride(1), 0)
            l = lse if lse is not None else out
            l_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
        mask = plan.mask if plan.mask is not None else plan.kv_lens
        mask_indptr = plan.mask_indptr if plan.mask_indptr is not None else plan.kv_lens
        mask_free = plan.mask_free if plan.mask_free is not None else plan.kv_lens
        kv_start = plan.extra.get("kv_start")
        paged_attention_kernel[(a.num_tiles, cfg.num_kv_heads, a.num_splits)](
            q, k_cache, v_cache, o, l,
            plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, a.tile_req, a.tile_qstart,
            mask, mask_indptr, mask_free, kv_start if kv_start is not None else plan.kv_lens,
            cfg.scale, cfg.logits_soft_cap, cfg.window_left, a.num_splits,
            q.stride(0), q.stride(1),
            *ks, *vs, *o_strides, *l_strides,
            GROUP=cfg.group_size, BLOCK_Q=a.block_q, BLOCK_M=a.block_m, BLOCK_N=a.block_n,
            HEAD_DIM=cfg.head_dim, BLOCK_D=_next_pow2(cfg.head_dim), PAGE_SIZE=cfg.page_size,
            CAUSAL=plan.causal and plan.mask is None, HAS_MASK=plan.mask is not None,
            SOFT_CAP=cfg.logits_soft_cap > 0, WINDOW=cfg.window_left >= 0,
            SPLIT=split, STORE_LSE=lse is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            UPCAST=q.device.type == "cpu", HAS_KV_START=kv_start is not None,
            num_warps=a.num_warps, num_stages=a.num_stages,
        )
        if split:
            merge_splits(a.partial, a.partial_lse, out, lse)
