"""Programmatic dependent launch (Hopper and later): a kernel launched with ``launch_pdl=True`` may start
while the kernel before it in the stream is still running, once every program of that one has called
``gdc_launch_dependents`` (or exited).

Used by the cascade's graph path (:meth:`~attnplug.core.providers.triton.TritonProvider.run_merge`): the
prefix part's kernel reads nothing the suffix part writes, so it starts on the SMs the suffix's last
programs leave free; it calls ``gdc_wait`` before it exits, so its completion implies the suffix's; the
merge after it waits (``gdc_wait``) for the prefix part before reading either state.

``ATTNPLUG_PDL=0`` turns it off (every launch then waits for the one before it, as without PDL).
"""

from __future__ import annotations

import torch

from ..config import env_flag

try:  # triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # the kernels then never take the PDL branches (available() is False)
    gdc_launch_dependents = gdc_wait = None

PDL_ENV = "ATTNPLUG_PDL"


def available(device: torch.device) -> bool:
    """Whether launches on ``device`` may use PDL: a CUDA device of compute capability >= 9.0, a torch
    built with CUDA >= 12.3 (PDL launches inside CUDA-graph captures), a triton with grid-dependency
    control, and ``$ATTNPLUG_PDL`` not ``0``."""
    if not env_flag(PDL_ENV, True) or gdc_wait is None or device.type != "cuda" or not torch.version.cuda:
        return False
    if tuple(int(x) for x in torch.version.cuda.split(".")[:2]) < (12, 3):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)
