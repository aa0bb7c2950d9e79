"""Launches a captured CUDA graph skips at replay time: a CUDA IF node on a device predicate.

torch's ``CUDAGraph`` (the engines capture with ``torch.cuda.graph``) can open a conditional child
graph inside a capture: ``get_currently_capturing_graph()``, ``begin_capture_to_if_node(pred)``,
``end_capture_to_conditional_node()`` (the bindings ``torch.cond`` uses; CUDA >= 12.4, CUDA builds
of torch only). Launches captured in between replay only when the 0-dim bool ``pred`` is true at
replay; a one-element kernel reading ``pred`` is the only cost of a skipped body.

``ATTNPLUG_GRAPH_IF=1`` turns this on; unset / ``0`` (the default until it has run on a GPU) captures
the body unconditionally (every launch replays, the launches themselves return at once when their
part is empty).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

GRAPH_IF_ENV = "ATTNPLUG_GRAPH_IF"


def capturing_graph():
    """torch's ``CUDAGraph`` capturing on the current stream when it can open IF nodes; else None
    (``ATTNPLUG_GRAPH_IF`` not ``1``, not capturing, a CPU or older torch, a capture torch did not start)."""
    if os.environ.get(GRAPH_IF_ENV, "0") != "1" or not torch.cuda.is_available():
        return None
    if not torch.cuda.is_current_stream_capturing():
        return None
    cls = torch.cuda.CUDAGraph
    if not all(hasattr(cls, m) for m in ("get_currently_capturing_graph", "begin_capture_to_if_node",
                                         "end_capture_to_conditional_node")):
        return None
    try:
        return cls.get_currently_capturing_graph()
    except RuntimeError:  # a raw stream capture, not a torch CUDAGraph
        return None


@contextmanager
def captured_if(pred: torch.Tensor):
    """Inside a capture, the body's launches replay only while ``pred`` (0-dim bool, device) is true;
    elsewhere (eager, CPU) the body runs as is and must itself be correct for a false ``pred``."""
    g = capturing_graph()
    if g is not None:
        try:
            g.begin_capture_to_if_node(pred)
        except RuntimeError:  # e.g. a CUDA runtime without conditional nodes: capture unconditionally
            g = None
    try:
        yield
    finally:
        if g is not None:
            g.end_capture_to_conditional_node()
