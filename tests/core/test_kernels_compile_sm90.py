"""Ahead-of-time compile of the replay-metadata kernel for Hopper (sm90 cubin) on a machine without a
GPU: every variant the adapters launch (vLLM page table, SGLang token table + row ids, FA3 block
table, chain mask; int32 / int64 inputs) must get through Triton's whole NVIDIA pipeline (TTIR ->
TTGIR -> LLVM -> PTX -> ptxas). The interpreter tests check what the kernel computes; this checks the
compiled form exists. Runs in a subprocess because the interpreter (TRITON_INTERPRET=1, set for the
other tests) replaces @triton.jit functions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import itertools, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from attnplug.core.kernels.graph_update import graph_batch_from_block_table_kernel as k

    names = list(k.arg_names)
    OUT = {"KV_INDPTR": "*i32", "KV_INDICES": "*i32", "KV_LAST": "*i32", "KV_LENS": "*i32", "BT_OUT": "*i32",
           "MASK_FREE": "*i32", "MASK": "*u8", "MASK_INDPTR": "*i64"}
    n = 0
    for idx_t, (row, entry), (bt_out, chain) in itertools.product(
            ["i32", "i64"], [(False, 1), (True, 1), (True, 16)], [(False, False), (True, False), (False, True)]):
        const = dict(Q=4 if chain else 1, BLOCK_B=64, BLOCK_J=128, BLOCK_E=1024, HAS_BT_OUT=bt_out,
                     CHAIN_MASK=chain, HAS_ROW_IDX=row, ENTRY_TOKENS=entry)
        ptrs = {"SEQ": f"*{idx_t}", "BT": "*i32", "ROW_IDX": "*i64", **OUT}
        sig = {a: "constexpr" if a in const else ptrs.get(a, "i32") for a in names}
        src = ASTSource(fn=k, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()})
        cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        assert len(cubin) > 1000, len(cubin)
        n += 1
    print("compiled", n)
    """
)


def test_graph_update_kernel_compiles_for_sm90(tmp_path):
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile every run, not a cached cubin
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().endswith("compiled 18"), r.stdout
