"""``core.graph_if.captured_if``: outside a capture (eager, CPU) the body runs whatever the
predicate; ``ATTNPLUG_GRAPH_IF`` selects whether a capture opens an IF node (the capture itself:
tests/core/test_cascade_graph.py on CUDA)."""

from __future__ import annotations

import pytest
import torch

from attnplug.core import graph_if


@pytest.mark.parametrize("env", [None, "0", "1"])
@pytest.mark.parametrize("pred", [False, True])
def test_body_runs_outside_a_capture(env, pred, monkeypatch):
    if env is None:
        monkeypatch.delenv(graph_if.GRAPH_IF_ENV, raising=False)
    else:
        monkeypatch.setenv(graph_if.GRAPH_IF_ENV, env)
    assert graph_if.capturing_graph() is None
    ran = []
    with graph_if.captured_if(torch.tensor(pred)):
        ran.append(1)
    assert ran == [1], "eager: the body is the caller's to make correct for a false predicate"


def test_off_unless_asked(monkeypatch):
    """Even while capturing, no IF node unless ATTNPLUG_GRAPH_IF=1 (checked before any CUDA call)."""
    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert graph_if.capturing_graph() is None
    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, "1")
    calls = []

    class FakeGraph:
        @staticmethod
        def get_currently_capturing_graph():
            calls.append("get")
            return FakeGraph()

        def begin_capture_to_if_node(self, pred):
            calls.append(("begin", bool(pred)))

        def end_capture_to_conditional_node(self):
            calls.append("end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    with graph_if.captured_if(torch.tensor(False)):
        calls.append("body")
    assert calls == ["get", ("begin", False), "body", "end"]
