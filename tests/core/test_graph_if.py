"""``core.graph_if``: ``ATTNPLUG_GRAPH_IF=1`` refused at startup where torch cannot open IF nodes;
``captured_if`` outside a capture (eager, CPU) runs the body whatever the
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


class _Bindings:
    """A ``torch.cuda.CUDAGraph`` stand-in with the IF-node bindings (their bodies are not called)."""

    get_currently_capturing_graph = begin_capture_to_if_node = end_capture_to_conditional_node = None


@pytest.mark.parametrize("env", ["1", "on"])
def test_asked_for_without_the_bindings_is_refused_at_startup(env, monkeypatch):
    """torch 2.11 (the H200's) has no IF-node bindings: ATTNPLUG_GRAPH_IF=1 there is refused, naming
    attnplug, the backend, the variable and the torch build, never replaced by an unconditional capture."""
    from attnplug.core.cascade import graph_cascade_mode
    from attnplug.core.providers.base import GraphSupport

    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, env)
    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("OldGraph", (), {}))
    with pytest.raises(ValueError) as e:
        graph_cascade_mode(GraphSupport(True, True, True, cascade=True), "ATTNPLUG_TRITON")
    for part in (
        "attnplug: backend ATTNPLUG_TRITON",
        "ATTNPLUG_GRAPH_IF=1",
        torch.__version__,
        "begin_capture_to_if_node",
    ):
        assert part in str(e.value)
    # with the bindings the same configuration starts
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Bindings)
    assert graph_cascade_mode(GraphSupport(True, True, True, cascade=True), "ATTNPLUG_TRITON") == "auto"
    # where cascade graphs are off the variable has nothing to do: no refusal
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("OldGraph", (), {}))
    assert graph_cascade_mode(GraphSupport(True, True, True, cascade=False), "ATTNPLUG_FLASHINFER") == "off"
    monkeypatch.setenv("ATTNPLUG_CASCADE_GRAPHS", "0")
    assert graph_cascade_mode(GraphSupport(True, True, True, cascade=True), "ATTNPLUG_TRITON") == "off"


def test_without_cuda_it_is_refused(monkeypatch):
    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="attnplug: backend X cannot honour ATTNPLUG_GRAPH_IF=1.*no CUDA device"):
        graph_if.check_requested("X")
    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, "0")
    graph_if.check_requested("X")  # not asked for: nothing to refuse


@pytest.mark.parametrize("value", ["2", "yes", "true"])
def test_a_malformed_value_is_refused(value, monkeypatch):
    from attnplug.core.cascade import graph_cascade_mode
    from attnplug.core.providers.base import GraphSupport

    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, value)
    with pytest.raises(ValueError, match=f"attnplug: ATTNPLUG_GRAPH_IF must be 0 or 1, got '{value}'"):
        graph_cascade_mode(GraphSupport(True, True, True, cascade=False))


def test_a_failed_if_node_is_an_error_not_an_unconditional_capture(monkeypatch):
    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    class NoConditionals(_Bindings):
        @staticmethod
        def get_currently_capturing_graph():
            return NoConditionals()

        def begin_capture_to_if_node(self, pred):
            raise RuntimeError("CUDA driver without conditional nodes")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", NoConditionals)
    ran = []
    with pytest.raises(RuntimeError, match="attnplug: ATTNPLUG_GRAPH_IF=1 could not open a CUDA IF node"):
        with graph_if.captured_if(torch.tensor(True)):
            ran.append(1)
    assert ran == []


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA-graph bindings at all")
def test_this_cuda_build_of_torch_states_its_bindings():
    """CUDA builds: 2.11.0+cu130 has no IF-node bindings (probed on the H200, 2026-12-02), 2.15.0 has
    them (the ``newest`` suite resolves its CUDA build): a torch that drops or adds them shows here."""
    have = all(hasattr(torch.cuda.CUDAGraph, m) for m in graph_if.BINDINGS)
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if major_minor >= (2, 15):
        assert have, f"torch {torch.__version__} lost the CUDAGraph IF-node bindings"
    elif major_minor <= (2, 11):
        assert not have


def test_a_capture_without_the_bindings_is_refused_too(monkeypatch):
    """A capture that did not go through an adapter's startup check (the core used directly, e.g.
    the benchmark) is refused at the capture, not captured unconditionally."""
    monkeypatch.setenv(graph_if.GRAPH_IF_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("OldGraph", (), {}))
    ran = []
    with pytest.raises(ValueError, match="attnplug cannot honour ATTNPLUG_GRAPH_IF=1.*begin_capture_to_if_node"):
        with graph_if.captured_if(torch.tensor(True)):
            ran.append(1)
    assert ran == []
