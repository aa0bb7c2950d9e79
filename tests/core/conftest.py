import os
import sys

# The Triton interpreter must be chosen before triton is imported; on a CUDA machine the kernels
# are compiled instead (set ATTNPLUG_TEST_COMPILED=1 there, or just have CUDA available).
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))
if os.environ.get("TRITON_INTERPRET") == "1":
    # what the triton provider installs on CPU (check_available), also for the tests that launch kernels directly
    from attnplug.core.providers import triton_interp

    triton_interp.install()
