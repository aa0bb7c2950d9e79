"""attnplug.compat.contract, the source-level engine-contract checker, on a synthetic engine package:
each rule reports what it must (and nothing when the interface is compatible)."""

from __future__ import annotations

import textwrap

from attnplug.compat import contract as C

ENGINE = {
    "eng/__init__.py": "",
    "eng/base.py": """
        from typing import Generic, TypeVar
        T = TypeVar("T")
        GROUP = "eng.plugins"
        class Root:
            flag: bool = False
            def build(self, a, b, fast=False): ...
        class Backend(Root, Generic[T]):
            def __init__(self, spec, names):
                self.device = spec
            @staticmethod
            def get_name(): ...
            def forward(self, q, k, *, scale=None): ...
            def kw(self, **kwargs): ...
        """,
    "eng/api.py": "from .base import Backend as Backend\n",
    "eng/layer.py": """
        def run(impl, obj):
            impl.do_write(1, 2, 3)
            obj.do_write(1)          # another receiver: ignored with recv="impl"
            impl_cls(1, 2, **extra)
        """,
}
OURS = {
    "mine/__init__.py": "",
    "mine/b.py": """
        class Ours:
            def build(self, a, b, fast=False): ...
            def build_bad(self, a, c, fast): ...
            def build_extra(self, a, b, fast=False, needed=None, must=1): ...
            def build_req(self, a, b, fast=False, *, must): ...
            def get_name(cls): ...
            def forward(self, q, k, scale=None): ...
            def forward_nokw(self, q, k): ...
            def write(self, x, y, z): ...
            def write_kw(self, x, y, z, **kw): ...
        """,
}


def tree(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return C.SourceTree(str(tmp_path))


def run(tmp_path, *items):
    eng = tree(tmp_path / "e", ENGINE)
    ours = tree(tmp_path / "o", OURS)
    return {r.item.ours or r.item.name: r for r in C.check(items, eng, ours)}


def test_resolution_through_reexports_bases_and_self_attributes(tmp_path):
    r = run(
        tmp_path,
        C.attr("eng.api", "Backend.flag"),
        C.attr("eng.api", "Backend.device"),
        C.attr(("eng.nowhere", "eng.api"), "Backend.build"),
        C.const("eng.base", "GROUP", "eng.plugins"),
        C.attr("eng.api", "Backend.gone", required=False),
    )
    assert all(x.ok for x in r.values()), C.report(r.values(), "t")
    assert r["Backend.flag"].found == "eng.base" and not r["Backend.gone"].found
    bad = run(tmp_path, C.attr("eng.api", "Backend.gone"), C.const("eng.base", "GROUP", "other"))
    assert "Backend.gone not found in eng.api" in bad["Backend.gone"].problems[0]
    assert "'eng.plugins', attnplug expects 'other'" in bad["GROUP"].problems[0]


def test_override_rules(tmp_path):
    o = "mine.b:Ours."
    r = run(
        tmp_path,
        *(
            C.override("eng.api", f"Backend.{e}", o + m)
            for e, m in [
                ("build", "build"),
                ("build", "build_bad"),
                ("build", "build_extra"),
                ("build", "build_req"),
                ("get_name", "get_name"),
                ("forward", "forward"),
                ("forward", "forward_nokw"),
            ]
        ),
    )
    assert r[o + "build"].ok and r[o + "build_extra"].ok and r[o + "get_name"].ok and r[o + "forward"].ok
    bad = " | ".join(r[o + "build_bad"].problems)
    assert "parameter 2 is 'b' in the engine, 'c' in attnplug" in bad
    assert "'fast' is optional in the engine but required by attnplug" in bad
    assert "attnplug requires 'must', which the engine never passes" in r[o + "build_req"].problems[0]
    assert "engine keyword 'scale' is not accepted by attnplug" in r[o + "forward_nokw"].problems[0]


def test_call_rules(tmp_path):
    r = run(
        tmp_path,
        C.call("eng.base", "Backend", npos=2),
        C.call("eng.base", "Backend.build", npos=2, lead=("a", "b")),
        C.call("eng.base", "Root.build", npos=1, kwargs=("x",), lead=("b",)),
    )
    assert r["Backend"].ok and r["Backend.build"].ok
    probs = " | ".join(r["Root.build"].problems)
    assert "does not bind" in probs and "leading parameters are ['a'], attnplug relies on ['b']" in probs


def test_call_sites_bind_our_method(tmp_path):
    o = "mine.b:Ours."
    r = run(
        tmp_path,
        C.callsite("eng.layer", "do_write", o + "write", recv="impl"),
        C.callsite("eng.layer", "impl_cls", o + "write_kw"),
        C.callsite("eng.layer", "impl_cls", o + "write"),
        C.callsite("eng.layer", "never_called", o + "forward"),
    )
    assert r[o + "write"].ok is False  # impl_cls(1, 2, **extra): ours has no **kwargs, and misses z
    assert r[o + "write_kw"].ok is False and "missing a required argument: 'z'" in r[o + "write_kw"].problems[0]
    assert "no call of never_called(...) in eng.layer" in r[o + "forward"].problems[0]
    only = run(tmp_path, C.callsite("eng.layer", "do_write", o + "write", recv="impl"))
    assert only[o + "write"].ok  # obj.do_write(1) is another receiver's call
