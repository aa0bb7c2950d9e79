"""Logging under vLLM: the core's ``attnplug`` logger reaches vLLM's handlers exactly once (vLLM
configures only its ``vllm`` logger), and the "active" line names the attnplug and vLLM versions."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def handlers():
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # attnplug's register(), through the entry point
    vllm_h, root_h = Collect(), Collect()
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)  # what vLLM's own configure_logging sets (after plugins load)
    vllm_logger.addHandler(vllm_h)
    logging.getLogger().addHandler(root_h)
    yield SimpleNamespace(vllm=vllm_h, root=root_h)
    vllm_logger.removeHandler(vllm_h)
    vllm_logger.setLevel(level)
    logging.getLogger().removeHandler(root_h)


def test_core_logger_reaches_vllm_once(handlers):
    from attnplug.vllm_adapter import compat

    compat.route_core_logging()  # again: idempotent
    core = logging.getLogger("attnplug")
    assert [type(h).__name__ for h in core.handlers].count("_ToVllmLogger") == 1 and not core.propagate
    core.info("core says %d", 42)
    core.debug("below vLLM's level")
    logging.getLogger("attnplug.providers").info("child says hi")
    got = [r.getMessage() for r in handlers.vllm.records if r.name.startswith("attnplug")]
    assert got == ["core says 42", "child says hi"]  # once each, at vLLM's INFO level
    # root sees each record once at most: only through vLLM's logger, and only if vLLM propagates
    at_root = [r.getMessage() for r in handlers.root.records if r.name.startswith("attnplug")]
    assert at_root == (got if logging.getLogger("vllm").propagate else [])


def test_active_line_names_attnplug_and_vllm_versions(handlers):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import attnplug
    from attnplug.vllm_adapter import backend as B
    from attnplug.vllm_adapter import compat

    cfg = VllmConfig()
    impl = B.AttnplugTritonBackend.get_impl_cls()(4, 64, 0.125, 2)
    cfg.compilation_config.static_forward_context["l0"] = SimpleNamespace(impl=impl)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    B.AttnplugTritonBackend.get_builder_cls()(spec, ["l0"], cfg, torch.device("cpu"))
    lines = [r.getMessage() for r in handlers.vllm.records if "ATTNPLUG_TRITON active" in r.getMessage()]
    want = f"attnplug {attnplug.__version__}, vLLM {compat.vllm_version()})"
    assert lines and all(
        line.startswith("attnplug: ATTNPLUG_TRITON active (provider ") and line.endswith(want) for line in lines
    ), lines
    assert compat.vllm_version().startswith("0.32.0")
