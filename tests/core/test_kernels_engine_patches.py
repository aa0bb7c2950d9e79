"""attnplug's kernels under the engines' monkeypatches of ``triton``.

SGLang 0.5.17 replaces ``triton.next_power_of_2`` with a plain Python function at import
(``sglang/srt/utils/common.py``). A ``@triton.jit`` body that calls ``triton.next_power_of_2`` then
fails when Triton hashes the kernel's dependencies, before any compile: "Unsupported function
referenced" (seen on the H200 inside SGLang's decode graph capture, fp8 KV, 2026-12-02). The CPU
interpreter never hashes dependencies, so these tests compute every kernel's ``cache_key`` (the step
that failed) in a subprocess with real JIT functions (no ``TRITON_INTERPRET``), no GPU needed:
``tests/kernel_hash_check.py``. ``tests/sglang/test_register.py`` runs it after importing SGLang itself."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = Path(__file__).resolve().parents[1] / "kernel_hash_check.py"


def _env() -> dict[str, str]:
    """This process's environment without ``TRITON_INTERPRET`` (real JIT functions), the repo first on
    ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(CHECK.parents[1])] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), mode], capture_output=True, text=True, env=_env(), timeout=300)


@pytest.mark.parametrize("mode", ["plain", "sglang-patch"])
def test_every_kernel_hashes_its_dependencies(mode):
    r = _run(mode)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = int(r.stdout.split("seen", 1)[1].split()[0])
    assert seen >= 10, r.stdout  # the decode, prefill, merge, kv-write, graph-update ... kernels


def test_the_check_fails_on_a_kernel_that_calls_triton_next_power_of_2(tmp_path):
    """The check itself: a kernel calling ``triton.next_power_of_2`` fails it under SGLang's patch."""
    src = textwrap.dedent(
        """
        import sys, triton, triton.language as tl
        def next_power_of_2(n):
            return 1 << (n - 1).bit_length() if n > 0 else 1
        setattr(triton, "next_power_of_2", next_power_of_2)

        @triton.jit
        def k(X, G: tl.constexpr):
            GP: tl.constexpr = triton.next_power_of_2(G)
            tl.store(X + tl.arange(0, GP), 0)

        try:
            k.cache_key
        except Exception as e:
            print("refused:", e)
            sys.exit(3)
        """
    )
    f = tmp_path / "k.py"
    f.write_text(src)
    r = subprocess.run([sys.executable, str(f)], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 3 and "Unsupported function" in r.stdout, r.stdout + r.stderr
