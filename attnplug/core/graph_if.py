"""Launches a captured CUDA graph skips at replay time: a CUDA IF node on a device predicate.

torch's ``CUDAGraph`` (the engines capture with ``torch.cuda.graph``) can open a conditional child
graph inside a capture: ``get_currently_capturing_graph()``, ``begin_capture_to_if_node(pred)``,
``end_capture_to_conditional_node()`` (the bindings ``torch.cond`` uses; CUDA >= 12.4, CUDA builds
of torch only: torch 2.11.0+cu130 has none, 2.15.0+cu132 has them). Launches captured in between
replay only when the 0-dim bool ``pred`` is true at replay; a one-element kernel reading ``pred`` is
the only cost of a skipped body.

``ATTNPLUG_GRAPH_IF=1`` turns this on; unset / ``0`` (the default until it has run on a GPU) captures
the body unconditionally (every launch replays, the launches themselves return at once when their
part is empty). Asked for where torch cannot open IF nodes, it is refused at startup
(:func:`check_requested`), never replaced by the unconditional capture.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .config import env_flag

GRAPH_IF_ENV = "ATTNPLUG_GRAPH_IF"
BINDINGS = ("get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node")


def requested() -> bool:
    """Whether ``$ATTNPLUG_GRAPH_IF`` asks for IF nodes (``1``); a value other than 0 / 1 is refused."""
    return env_flag(GRAPH_IF_ENV, False)


def missing() -> str | None:
    """Why this torch cannot open IF nodes in a capture (None: it can)."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA device"
    lacking = [m for m in BINDINGS if not hasattr(torch.cuda.CUDAGraph, m)]
    if lacking:
        return f"torch {torch.__version__} lacks the conditional-node bindings CUDAGraph.{', .'.join(lacking)}"
    return None


def check_requested(who: str | None = None) -> None:
    """At startup, for the backend named ``who`` whose decode graphs run cascade: ``ATTNPLUG_GRAPH_IF=1``
    on a torch that cannot open IF nodes raises ``ValueError`` naming attnplug, the backend, the variable
    and the torch build."""
    if requested() and (why := missing()) is not None:
        subject = f"attnplug: backend {who}" if who else "attnplug"
        raise ValueError(
            f"{subject} cannot honour {GRAPH_IF_ENV}=1 (the cascade prefix part of CUDA "
            f"graphs in a CUDA IF node): {why}. Unset {GRAPH_IF_ENV} or set it to 0."
        )


def capturing_graph():
    """torch's ``CUDAGraph`` capturing on the current stream, when ``ATTNPLUG_GRAPH_IF`` is ``1``; else
    None (not asked for, not capturing, a capture torch did not start). Asked for on a torch that
    cannot open IF nodes, it raises as :func:`check_requested` does at startup."""
    if not requested() or not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        return None
    check_requested()
    try:
        return torch.cuda.CUDAGraph.get_currently_capturing_graph()
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
        except RuntimeError as e:  # e.g. a CUDA runtime without conditional nodes
            raise RuntimeError(
                f"attnplug: {GRAPH_IF_ENV}=1 could not open a CUDA IF node in this capture "
                f"({e}); unset {GRAPH_IF_ENV} or set it to 0"
            ) from e
    try:
        yield
    finally:
        if g is not None:
            g.end_capture_to_conditional_node()
