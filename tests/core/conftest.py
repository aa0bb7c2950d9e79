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
