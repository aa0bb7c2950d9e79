"""The SGLang adapter's contract (``compat.CONTRACT`` and, for EAGLE, ``compat.DRAFT_CONTRACT``)
against SGLang's *sources* (``ast``, nothing imported): the installed SGLang 0.5.23, the newest
release on PyPI (checked 2026-11-30). Items: registry, CLI choices and hooks, the
``AttentionBackend`` methods attnplug overrides (CUDA-graph API included), the pool / batch /
layer / model-runner members it reads, and the EAGLE draft factory and graph-runner call sites.
A mutated copy proves the check fails when a method vanishes or a signature changes, and that
attnplug then refuses with a message instead of a traceback.
"""

from __future__ import annotations

import ast
import os
import shutil

import pytest

import attnplug
from attnplug.compat import contract as _contract
from attnplug.sglang_adapter import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = _contract.SourceTree(ROOT)
BASE = "sglang/srt/layers/attention/base_attn_backend.py"
POOL = "sglang/srt/mem_cache/memory_pool.py"


def installed_root() -> str:
    import sglang

    return os.path.dirname(os.path.dirname(sglang.__file__))


def check(root: str, label: str, items=None):
    results = _contract.check(items or compat.CONTRACT + compat.DRAFT_CONTRACT, _contract.SourceTree(root), OURS)
    return results, _contract.report(results, label)


def test_contract_holds_on_installed_sglang():
    results, text = check(installed_root(), f"sglang {compat.sglang_version()}")
    print(text)
    assert all(r.ok for r in results), text
    assert sum(1 for r in results if r.found) >= 50, text


def test_contract_lists_every_override_of_the_adapter():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from attnplug.sglang_adapter.backend import AttnplugAttnBackend

    listed = {it.name for it in compat.CONTRACT if it.kind == "override"}
    missing = [
        f"AttentionBackend.{n}"
        for n in vars(AttnplugAttnBackend)
        if not n.startswith("_")
        and callable(getattr(AttentionBackend, n, None))
        and f"AttentionBackend.{n}" not in listed
    ]
    assert not missing, f"attnplug overrides these SGLang methods; add them to compat.CONTRACT: {missing}"


@pytest.fixture(scope="module")
def broken_sglang(tmp_path_factory) -> str:
    """SGLang's sources with three breaks: ``init_forward_metadata_out_graph`` gone from the base,
    ``forward_decode`` with a new required parameter, ``set_kv_buffer`` taking one more."""
    src, dst = installed_root(), str(tmp_path_factory.mktemp("sglang-broken"))
    for rel in (BASE, POOL):
        with open(os.path.join(src, rel)) as f:
            tree = ast.parse(f.read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for m in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
                if cls.name == "AttentionBackend" and m.name == "init_forward_metadata_out_graph":
                    cls.body.remove(m)
                elif cls.name == "AttentionBackend" and m.name == "forward_decode":
                    m.args.args.insert(6, ast.arg("attn_meta"))  # after forward_batch, before save_kv_cache
                elif cls.name == "MHATokenToKVPool" and m.name == "set_kv_buffer":
                    m.args.args.insert(5, ast.arg("layout"))
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        with open(os.path.join(dst, rel), "w") as f:
            f.write(ast.unparse(tree))
    shutil.copytree(
        os.path.join(src, "sglang"),
        os.path.join(dst, "sglang"),
        dirs_exist_ok=True,
        ignore=lambda d, names: [
            n for n in names if os.path.join(d, n).endswith((BASE, POOL)) or n in ("models", "__pycache__")
        ],
    )
    return dst


def test_check_reports_each_break(broken_sglang):
    results, text = check(broken_sglang, "sglang (mutated)", compat.CONTRACT)
    bad = {r.item.name: r for r in results if not r.ok}
    assert set(bad) == {
        "AttentionBackend.init_forward_metadata_out_graph",
        "AttentionBackend.forward_decode",
        "MHATokenToKVPool.set_kv_buffer",
    }, text
    assert not bad["AttentionBackend.init_forward_metadata_out_graph"].found, text
    assert "attn_meta" in " ".join(bad["AttentionBackend.forward_decode"].problems), text
    assert "does not bind" in " ".join(bad["MHATokenToKVPool.set_kv_buffer"].problems), text


def test_refusal_outside_the_tested_range(broken_sglang, monkeypatch):
    msg = compat.engine_refusal(version="0.6.0", engine_root=broken_sglang)
    assert msg and msg.startswith(
        f"attnplug {attnplug.__version__}: SGLang 0.6.0 is outside the tested range "
        "0.5.17..0.5.23 and its attention-backend interface changed"
    ), msg
    assert "init_forward_metadata_out_graph not found" in msg and "attn_meta" in msg, msg
    assert compat.engine_refusal(version="0.5.23", engine_root=broken_sglang) is None  # in range: not checked
    assert compat.engine_refusal(version="0.6.0", engine_root=installed_root()) is None  # unchanged: served

    # selecting a refused backend: SGLang calls the registered factory, which raises the message
    from attnplug import sglang_adapter

    monkeypatch.setattr(compat, "engine_refusal", lambda *a, **k: msg)
    with pytest.raises(
        RuntimeError, match=r"SGLang 0\.6\.0 is outside the tested range.*\(selected: attnplug_triton\)"
    ):
        sglang_adapter._factory("attnplug_triton", object())


def test_active_line_names_attnplug_and_sglang_versions(caplog):
    import logging

    from sglang.srt.runtime_context import get_parallel
    from sglang_helpers import make_runner

    from attnplug.sglang_adapter.backend import AttnplugAttnBackend

    with caplog.at_level(logging.INFO, logger="attnplug.sglang_adapter.backend"):
        with get_parallel().override(attn_tp_size=1, attn_dcp_size=1):
            AttnplugAttnBackend(make_runner(16), backend_name="attnplug_triton")
    want = f", attnplug {attnplug.__version__}, SGLang {compat.sglang_version()})"
    lines = [r.getMessage() for r in caplog.records if "attnplug_triton active" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(want), lines
    assert compat.sglang_version() == "0.5.23"
