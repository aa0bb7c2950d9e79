"""vLLM adapter tests: run with ``.venvs/vllm/bin/python -m pytest tests/vllm -q``.

Build the venv with ``scripts/setup_vllm_env.sh``; outside it (no ``vllm``) this directory is
skipped at collection. Helpers live in ``vllm_test_helpers.py``. ``TRITON_INTERPRET=1`` is set
here (no CUDA) for the in-process unit tests only: the engine subprocesses get a clean
environment, because attnplug must switch the interpreter on by itself (that is under test too).
"""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]  # not the vLLM venv: nothing to test here
else:
    import torch

    if not torch.cuda.is_available():  # triton decides interpreted-vs-compiled at import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
