"""SGLang test environment (CPU): run with ``.venvs/sglang/bin/python -m pytest tests/sglang -q``.

Build the venv with ``scripts/setup_sglang_env.sh`` (SGLang 0.5.23; the same suite runs against
SGLang 0.5.17 in ``.venvs/sglang0517``, built by ``scripts/setup_sglang0517_env.sh``; ``scripts/test.sh``
runs the adapter unit tests there, suite ``sglang0517``). Outside an SGLang venv (no ``sglang``) the whole
directory is skipped at collection. Sets, for this process and the subprocesses the tests start:
``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU platform), ``HF_HUB_OFFLINE=1``, and puts the TEST-ONLY
``sgl_kernel_shim`` on the path (the real sgl_kernel wheel is CUDA-only). ``TRITON_INTERPRET`` is
set here for the in-process unit tests only; the engine subprocesses do not get it, because the
``attnplug_triton`` backend turns the interpreter on by itself on CPU (that is under test too).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIM = HERE / "sgl_kernel_shim"

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]  # not the SGLang venv: nothing to test here
else:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    for p in (SHIM, HERE):  # the shim, and sglang_helpers.py
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from attnplug.tools.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
