"""The plans of a triton decode graph with cascade on and off, without a GPU (issue 43): what each part launches.

    TRITON_INTERPRET=1 python benchmarks/probes/cascade_graph_plans.py [--sms 132] [--sizes 8,32,64] [--ctxs 1024,8192]

Llama-3-8B attention (32/8 heads, d 128, page 16, bf16). For each ``bs`` requests x ``ctx`` tokens, a decode
``GraphState`` with ``cascade="off"`` and one with ``"auto"``, the provider planning as on a GPU of ``--sms``
SMs; printed per part (suffix: the graph's own plan; prefix: the cascade's shared-prefix part): kernel, tiles,
splits, ``block_m``, warps, fused merge, whether its programs stride over the cut groups' tiles, and the
programs it launches (tiles, or the strided grid, x KV heads x splits), which a replay pays whether or not its
batch shares anything. ``--max-batch``: the graph family's size, as an engine's (captured at ``bs``).
``docs/cascade.md`` reads them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # plans only: no kernel runs
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import attnplug.core.providers.triton as triton_provider  # noqa: E402
from attnplug.core import AttentionConfig  # noqa: E402
from attnplug.core.cuda_graph import GraphState  # noqa: E402


def part(st, kv_heads: int) -> str:
    strided = getattr(st, "tile_count", None) is not None  # tiles for the cut groups only, strided over
    programs = (st.grid_tiles if strided else st.num_tiles) * kv_heads * st.num_splits
    return (
        f"{st.kernel:7s} tiles {st.num_tiles:3d} splits {st.num_splits:2d} block_m {st.block_m:3d} warps"
        f" {st.num_warps:2d} fused {str(st.counters is not None):5s} strided {str(strided):5s} programs {programs}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU planned for (H100 / H200: 132)")
    ap.add_argument("--sizes", default="2,8,32,64")
    ap.add_argument("--ctxs", default="1024,8192")
    ap.add_argument("--max-batch", type=int, default=256, help="the graph family's largest batch (0: bs)")
    a = ap.parse_args()
    triton_provider._num_sms = lambda device: a.sms
    cfg = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    for ctx in map(int, a.ctxs.split(",")):
        for bs in map(int, a.sizes.split(",")):
            for mode in ("off", "auto"):
                gs = GraphState(
                    cfg,
                    "triton",
                    max_batch=max(bs, a.max_batch),
                    max_tokens=max(bs, a.max_batch),
                    max_pages=bs * ctx // cfg.page_size + 8,
                    device="cpu",
                    mode="decode",
                    max_seq_len=ctx,
                    cascade=mode,
                )
                gs.prepare_capture(bs)
                print(f"{bs:3d} x {ctx:5d} cascade {mode:4s} suffix: {part(gs.plans[bs].state, cfg.num_kv_heads)}")
                if gs.cascade is not None:
                    print(f"{'':23s}prefix: {part(gs.cascade.plans[bs].state, cfg.num_kv_heads)}")


if __name__ == "__main__":
    main()
