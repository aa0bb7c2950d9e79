"""The flashinfer provider's calls into FlashInfer (``flashinfer.CALLS``) against FlashInfer's
*sources*, read with ``ast`` (FlashInfer needs CUDA to run): the H200-tested release 0.6.14, the
releases the newest engines pin (0.7.2.post1 by vLLM 0.33.0, 0.7.2 by SGLang 0.5.23) and the newest,
0.7.4 (what ``pip install 'attnplug[flashinfer]'`` resolves today). Every call must bind;
a mutated copy shows the check fails when a keyword or method vanishes, and that the provider then
refuses at startup with a message naming attnplug, the provider, the version and the change. The startup
check reads the imported library's signatures: here it runs on stand-in modules whose functions have the
signatures of a release's sources (:func:`stand_in`)."""

from __future__ import annotations

import ast
import os
import sys
import types

import pytest
import torch

from attnplug.compat import contract as _contract
from attnplug.compat.flashinfer import contract_items
from attnplug.core import AttentionConfig
from attnplug.core.providers import flashinfer as fip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from wheel_sources import wheel_sources  # noqa: E402

pytestmark = pytest.mark.network  # FlashInfer's released sources come from PyPI

VERSIONS = ("0.6.14", "0.7.2", "0.7.2.post1", "0.7.4")  # docs/compatibility.md: CPU CI "contract" rows
OURS = _contract.SourceTree(ROOT)


@pytest.fixture(scope="module", params=VERSIONS)
def fi_src(request):
    src = wheel_sources("flashinfer-python", request.param)
    assert os.path.isfile(os.path.join(src, "flashinfer", "prefill.py")), src
    return request.param, src


def results(src: str):
    return _contract.check(contract_items(), _contract.SourceTree(src), OURS)


def _stub(node):
    """``node`` (a function or class of a release's sources) with its signature kept and nothing else: no
    annotations, defaults ``None``, bodies ``pass``, decorators other than static/classmethod dropped."""
    if isinstance(node, ast.ClassDef):
        node.bases, node.keywords, node.decorator_list = [], [], []
        fns = [_stub(n) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        node.body = fns or [ast.Pass()]
        return node
    a = node.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
        arg.annotation = None
    a.defaults = [ast.Constant(None) for _ in a.defaults]
    a.kw_defaults = [ast.Constant(None) if d is not None else None for d in a.kw_defaults]
    node.returns, node.body = None, [ast.Pass()]
    keep = ("staticmethod", "classmethod")
    node.decorator_list = [d for d in node.decorator_list if getattr(d, "id", "") in keep]
    return node


def stand_in(src: str, edit=None):
    """``import_module`` for :func:`fip.interface_refusal`: each module of FlashInfer the provider calls,
    built from the sources under ``src`` (``edit(rel, text)``: the text used for file ``rel``); names a
    module re-exports with a relative ``from .x import name`` are taken from ``x``'s stand-in."""
    built: dict[str, types.ModuleType] = {}

    def import_module(name: str):
        if name not in built:
            built[name] = _build(name)
        return built[name]

    def _build(name: str) -> types.ModuleType:
        rel = name.split(".", 1)[1].replace(".", "/")
        rel = rel + "/__init__.py" if os.path.isdir(os.path.join(src, "flashinfer", rel)) else rel + ".py"
        with open(os.path.join(src, "flashinfer", rel)) as f:
            text = f.read()
        tree = ast.parse(edit(rel, text) if edit else text)
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        body = [_stub(n) for n in tree.body if isinstance(n, defs)]
        mod = types.ModuleType(name)
        exec(compile(ast.fix_missing_locations(ast.Module(body, [])), rel, "exec"), mod.__dict__)
        pkg = name if rel.endswith("__init__.py") else name.rsplit(".", 1)[0]
        reexports = {}  # relative re-exports, resolved when asked for (module __getattr__)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                reexports.update({a.asname or a.name: (f"{base}.{node.module}", a.name) for a in node.names})

        def getattr_(attr):
            if attr not in reexports:
                raise AttributeError(attr)
            module, orig = reexports.pop(attr)  # popped: a cycle ends in AttributeError
            try:
                value = getattr(import_module(module), orig)
            except (OSError, SyntaxError) as e:
                raise AttributeError(attr) from e
            setattr(mod, attr, value)
            return value

        mod.__getattr__ = getattr_
        return mod

    return import_module


def test_every_flashinfer_call_binds(fi_src):
    version, src = fi_src
    res = results(src)
    assert not _contract.problems(res), "\n".join(f"{r.item.label}: {r.problems}" for r in res)
    found = {r.item.name for r in res if r.found}
    assert len(found) == len(res), f"not found in flashinfer {version}: {[r.item.label for r in res if not r.found]}"
    assert fip.interface_refusal(version, import_module=stand_in(src)) is None


def test_the_contract_covers_the_numerics_the_provider_passes():
    """Every keyword of the provider's wrapper ``plan`` calls is one the contract checks."""
    prov = object.__new__(fip.FlashInferProvider)  # plan_kwargs reads only the config (no GPU here)
    prov.config = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    plans = [c for c in fip.CALLS if c.name.endswith(".plan") and "MLA" not in c.name]  # MLA: positional only
    assert len(plans) == 2
    for it in plans:
        assert set(prov.plan_kwargs()) <= set(it.kwargs), it.name


@pytest.mark.parametrize(
    "mutation, needle",
    [
        (
            (
                "prefill.py",
                "custom_mask: Optional[torch.Tensor] = None,",
                "custom_mask_v2: Optional[torch.Tensor] = None,",
            ),
            "custom_mask",
        ),
        (("decode.py", "        return_lse: bool = False,\n", ""), "return_lse"),  # the method, not its overloads
    ],
)
def test_a_changed_call_refuses_the_provider(mutation, needle):
    src = wheel_sources("flashinfer-python", "0.7.4")
    rel, old, new = mutation

    def edit(path, text):
        if path == rel:
            assert old in text, f"mutation anchor gone from flashinfer 0.7.4's {rel}"
            return text.replace(old, new)
        return text

    assert fip.interface_refusal("0.7.4", import_module=stand_in(src)) is None
    why = fip.interface_refusal("0.7.4", import_module=stand_in(src, edit))
    assert why and all(s in why for s in ("flashinfer 0.7.4", needle, "0.6.14")), why
    err = fip.FlashInferProvider.unavailable(why)
    assert str(err).startswith("attnplug: provider 'flashinfer' is unavailable: flashinfer 0.7.4 changed")


def test_a_tested_release_is_not_checked():
    def fail(name):
        raise AssertionError(f"a tested release was checked ({name})")

    assert fip.interface_refusal("0.6.14+cu130", import_module=fail) is None
