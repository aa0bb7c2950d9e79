"""Every Triton kernel launch the core makes compiles for Hopper (sm90 cubin), checked on a machine
without a GPU: ``sm90_aot.py`` runs the real plan/run code on representative batches with each
``kernel[grid]`` recorded instead of launched, then compiles each distinct launch through Triton's
NVIDIA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas). The interpreter tests check what the kernels
compute; this checks that their compiled form exists, so a kernel edit made without a GPU cannot
break the GPU build unnoticed. A subprocess, because the interpreter (TRITON_INTERPRET=1, set for the
other tests) replaces @triton.jit functions."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


SHARDS = 2  # the launches in two halves, one test each: xdist's loadgroup gives each group its own worker first


@pytest.mark.parametrize("shard", [pytest.param(i, marks=pytest.mark.xdist_group(f"sm90-{i}")) for i in range(SHARDS)])
def test_every_kernel_launch_compiles_for_sm90(tmp_path, shard):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine compiles and runs every kernel in the other tests")
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile every run, not a cached cubin
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(HERE)) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "sm90_aot.py"), "--shard", f"{shard}/{SHARDS}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    done, total = map(
        int,
        re.search(rf"compiled (\d+) distinct launches for sm90 \(shard {shard}/{SHARDS} of (\d+)\)", r.stdout).groups(),
    )
    assert done == len(range(shard, total, SHARDS)), r.stdout  # its share of every recorded launch
    (recorded,) = [line for line in r.stdout.splitlines() if line.startswith("recorded ")]
    counts = dict(re.findall(r"(\w+_kernel)=(\d+)", recorded))  # every recorded launch, both shards
    from attnplug.core.providers.triton import GLUON_TRITON

    gluon = GLUON_TRITON[0] <= tuple(int(x) for x in triton.__version__.split(".")[:2]) <= GLUON_TRITON[1]
    assert set(counts) == {
        "paged_attention_kernel",
        "merge_splits_kernel",
        "merge_state_kernel",
        "write_kv_kernel",
        "graph_batch_from_block_table_kernel",
        "quantize_rows_kernel",
        "prefill_kernel",
        "decode_kernel",
        "shared_pages_kernel",
        "apply_sinks_kernel",
        "mla_attention_kernel",
        "write_latent_kernel",
        "ragged_prefill_kernel",
    } | ({"gluon_prefill_kernel"} if gluon else set()), r.stdout
    assert int(counts["mla_attention_kernel"]) >= 8 and int(counts["write_latent_kernel"]) == 2, r.stdout
    assert int(counts["ragged_prefill_kernel"]) == 2, (
        r.stdout
    )  # causal 192/128 (16 and 128 heads: one launch), GQA d128
    assert not gluon or int(counts["gluon_prefill_kernel"]) >= 8, r.stdout  # d64 / d128 / d256, groups, LSE
    assert int(counts["prefill_kernel"]) >= 6 and int(counts["decode_kernel"]) >= 4, r.stdout  # the Hopper paths
    # the replay update: decode, chain and tree verify, each with and without a cascade cut, the cut with the tile
    # count of a strided prefix part or every slot's tiles
    assert int(counts["paged_attention_kernel"]) >= 16 and int(counts["graph_batch_from_block_table_kernel"]) == 10, (
        r.stdout
    )
    assert int(counts["write_kv_kernel"]) >= 5, r.stdout  # bf16, fp16 and three fp8 (quantizing) writes
