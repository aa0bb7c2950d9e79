"""What attnplug relies on in an engine's Python interface, checked from the engine's *sources*.

Each adapter's ``compat.py`` lists its engine contract as :class:`Item` s: methods attnplug overrides
(the engine's base signature must be callable on attnplug's override), engine callables attnplug
calls (the call must bind), call sites where the engine calls attnplug (every one must bind
attnplug's method), and attributes / enum members / dataclass fields / constants attnplug reads.
:func:`check` reads sources with :mod:`ast` (:class:`SourceTree`), nothing is imported, so the same
check runs

* in the tests, against an engine that cannot run here (vLLM 0.33 is CUDA-only: its wheel's
  sources), and against the installed engines;
* at registration, where an engine release outside the tested range is checked before attnplug's
  backends are offered (``compat.engine_refusal``).
"""

from __future__ import annotations

import ast
import inspect
import os
from dataclasses import dataclass

_DEFAULT = object()  # stands for "has a default" in signatures built from source
_P = inspect.Parameter


@dataclass(frozen=True)
class Item:
    """One thing attnplug relies on.

    kind: ``override`` (engine base method ``name`` vs attnplug's ``ours``), ``call`` (attnplug calls
        engine ``name`` with ``npos`` positional args and keywords ``kwargs``; ``lead``: the names
        its leading parameters must have), ``callsite`` (the engine calls ``.name(...)`` / ``name(...)``
        in module ``engine[0]``; each call must bind ``ours``), ``attr`` (class attribute, enum
        member, dataclass field, ``self.x`` set in a method, or module global), ``const`` (module
        global equal to ``value``).
    engine: candidate modules (the first that has ``name`` is used; releases move things).
    name: qualified name in the module (``Class.method``); ``A|B``: either one.
    """

    kind: str
    engine: tuple[str, ...]
    name: str
    ours: str = ""  # "module:Qual.name" (override / callsite)
    npos: int = 0
    kwargs: tuple[str, ...] = ()
    lead: tuple[str, ...] = ()
    value: object = None
    recv: str = ""  # callsite: only calls whose receiver's source ends with this (``draft_attn_backend``)
    required: bool = True
    why: str = ""

    @property
    def label(self) -> str:
        return f"{self.engine[0]}.{self.name}" if self.kind != "callsite" else f"{self.name}(...) in {self.engine[0]}"


def override(mod, name, ours, **kw) -> Item:
    return Item("override", _mods(mod), name, ours=ours, **kw)


def call(mod, name, npos=0, kwargs=(), lead=(), **kw) -> Item:
    return Item("call", _mods(mod), name, npos=npos, kwargs=tuple(kwargs), lead=tuple(lead), **kw)


def callsite(mod, name, ours, **kw) -> Item:
    return Item("callsite", _mods(mod), name, ours=ours, **kw)


def attr(mod, name, **kw) -> Item:
    return Item("attr", _mods(mod), name, **kw)


def const(mod, name, value, **kw) -> Item:
    return Item("const", _mods(mod), name, value=value, **kw)


def _mods(mod) -> tuple[str, ...]:
    return (mod,) if isinstance(mod, str) else tuple(mod)


# -- reading sources ---------------------------------------------------------------------------------
class SourceTree:
    """Python sources under one or more roots (directories holding top-level packages, e.g. a
    site-packages or an unpacked wheel), read with ``ast`` on demand."""

    def __init__(self, *roots: str):
        self.roots = [os.fspath(r) for r in roots]
        self._cache: dict[str, ast.Module | None] = {}

    def path(self, mod: str) -> str | None:
        rel = mod.replace(".", os.sep)
        for root in self.roots:
            for p in (os.path.join(root, rel + ".py"), os.path.join(root, rel, "__init__.py")):
                if os.path.isfile(p):
                    return p
        return None

    def module(self, mod: str) -> ast.Module | None:
        if mod not in self._cache:
            p = self.path(mod)
            if p is None:
                self._cache[mod] = None
            else:
                with open(p, encoding="utf-8") as f:
                    self._cache[mod] = ast.parse(f.read(), p)
        return self._cache[mod]

    def _imported(self, mod: str, name: str) -> tuple[str, str] | None:
        """``(module, name)`` that ``name`` is imported from at the top of ``mod``."""
        tree = self.module(mod)
        for node in tree.body if tree else ():
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        base = node.module or ""
                        if node.level:
                            pkg = mod.split(".")
                            is_pkg = (self.path(mod) or "").endswith("__init__.py")
                            pkg = pkg[: len(pkg) - node.level + (1 if is_pkg else 0)]
                            base = ".".join(pkg + ([node.module] if node.module else []))
                        return base, a.name
        return None

    def top(self, mod: str, name: str, depth: int = 0):
        """``(module, node)`` of top-level ``name`` in ``mod`` (class, function or assignment),
        following ``from x import name`` re-exports."""
        tree = self.module(mod)
        if tree is None or depth > 5:
            return None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return mod, node
        for node in tree.body:
            if name in _assigned(node):
                return mod, node
        src = self._imported(mod, name)
        if src is not None and src[0] != mod:
            return self.top(src[0], src[1], depth + 1)
        return None

    def bases(self, mod: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        out = []
        for b in cls.bases:
            while isinstance(b, ast.Subscript):  # Generic[T], AttentionImplBase[T]
                b = b.value
            name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
            found = self.top(mod, name) if name else None
            if found and isinstance(found[1], ast.ClassDef):
                out.append(found)
        return out

    def member(self, mod: str, cls: ast.ClassDef, name: str, seen=None):
        """``(module, node)`` defining ``name`` in ``cls`` or its bases (in these sources):
        a method, a class-level assignment, or ``self.name = ...`` in one of its methods."""
        seen = seen if seen is not None else set()
        if (mod, cls.name) in seen:
            return None
        seen.add((mod, cls.name))
        for node in cls.body:
            fn = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if fn and node.name == name and not _overload(node):
                return mod, node  # the implementation: ``@overload`` stubs before it are not what runs
            if name in _assigned(node):
                return mod, node
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr == name
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        return mod, node
        for bmod, base in self.bases(mod, cls):
            found = self.member(bmod, base, name, seen)
            if found:
                return found
        return None

    def resolve(self, mods: tuple[str, ...], qual: str):
        """``(module, node)`` of ``qual`` (``Name`` or ``Class.member``) in the first module that has it."""
        head, _, rest = qual.partition(".")
        for mod in mods:
            found = self.top(mod, head)
            if found is None:
                continue
            if not rest:
                return found
            if isinstance(found[1], ast.ClassDef):
                m = self.member(found[0], found[1], rest)
                if m:
                    return m
        return None


def _overload(fn) -> bool:
    """``fn`` is a ``typing.overload`` stub (``@overload`` / ``@typing.overload``)."""
    names = (d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list)
    return "overload" in names


def _assigned(node) -> set[str]:
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def signature(fn: ast.FunctionDef, method: bool = True) -> inspect.Signature:
    """The signature as callers see it (a method's ``self`` / ``cls`` dropped unless it is a
    staticmethod); defaults are a placeholder (only their presence matters)."""
    a = fn.args
    decos = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}
    params = []
    pos = [(p, _P.POSITIONAL_ONLY) for p in a.posonlyargs] + [(p, _P.POSITIONAL_OR_KEYWORD) for p in a.args]
    n_def = len(a.defaults)
    for i, (p, kind) in enumerate(pos):
        has_def = i >= len(pos) - n_def
        params.append(_P(p.arg, kind, default=_DEFAULT if has_def else _P.empty))
    if a.vararg:
        params.append(_P(a.vararg.arg, _P.VAR_POSITIONAL))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(_P(p.arg, _P.KEYWORD_ONLY, default=_P.empty if d is None else _DEFAULT))
    if a.kwarg:
        params.append(_P(a.kwarg.arg, _P.VAR_KEYWORD))
    if method and "staticmethod" not in decos and params and params[0].kind != _P.VAR_POSITIONAL:
        params = params[1:]
    return inspect.Signature(params)


def fmt(sig: inspect.Signature) -> str:
    return str(sig).replace(repr(_DEFAULT), "…")


# -- compatibility rules -----------------------------------------------------------------------------
def override_problems(engine: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """Why the engine, calling its base method's signature ``engine``, could not call ``ours``."""
    ps = list(ours.parameters.values())
    by_name = {p.name: p for p in ps if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
    positional = [p for p in ps if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == _P.VAR_POSITIONAL for p in ps)
    var_kw = any(p.kind == _P.VAR_KEYWORD for p in ps)
    out = []
    used = set()
    for i, e in enumerate(p for p in engine.parameters.values() if p.kind != _P.VAR_KEYWORD):
        optional = e.default is not _P.empty
        if e.kind == _P.VAR_POSITIONAL:
            if not var_pos:
                out.append(f"engine passes extra positional arguments (*{e.name}); attnplug's has no *args")
            continue
        mine = None
        if e.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD):
            if i >= len(positional) and var_kw and not var_pos and e.kind == _P.POSITIONAL_OR_KEYWORD:
                continue  # ``**kwargs`` override: the engine passes these by keyword (e.g. validate_configuration)
            if i < len(positional):
                mine = positional[i]
                if e.kind == _P.POSITIONAL_OR_KEYWORD and mine.name != e.name:
                    out.append(f"parameter {i + 1} is '{e.name}' in the engine, '{mine.name}' in attnplug")
            elif not var_pos:
                out.append(f"engine parameter '{e.name}' (position {i + 1}) is not accepted by attnplug")
                continue
        if e.kind == _P.KEYWORD_ONLY:
            mine = by_name.get(e.name)
            if mine is None and not var_kw:
                out.append(f"engine keyword '{e.name}' is not accepted by attnplug")
                continue
        if mine is not None:
            used.add(mine.name)
            if optional and mine.default is _P.empty:
                out.append(f"'{e.name}' is optional in the engine but required by attnplug")
    engine_names = {p.name for p in engine.parameters.values()}
    for p in ps:
        if (
            p.default is _P.empty
            and p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY, _P.POSITIONAL_ONLY)
            and p.name not in used
            and p.name not in engine_names
        ):
            out.append(f"attnplug requires '{p.name}', which the engine never passes")
    return out


def call_problems(engine: inspect.Signature, npos: int, kwargs, lead=()) -> list[str]:
    out = []
    try:
        engine.bind(*range(npos), **{k: 0 for k in kwargs})
    except TypeError as e:
        out.append(f"attnplug's call ({npos} positional, keywords {list(kwargs)}) does not bind: {e}")
    names = [p.name for p in engine.parameters.values() if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    if tuple(names[: len(lead)]) != tuple(lead):
        out.append(f"leading parameters are {names[: len(lead)]}, attnplug relies on {list(lead)}")
    return out


def _call_sites(tree: ast.Module, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                yield node


def _const_value(node):
    v = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    try:
        return ast.literal_eval(v) if v is not None else None
    except ValueError:
        return None


@dataclass
class Result:
    item: Item
    found: str  # "module" where it was found, or "" when missing
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def check(items, engine: SourceTree, ours: SourceTree) -> list[Result]:
    """Check every item against ``engine`` (sources) with attnplug's side read from ``ours``."""
    results = []
    for it in items:
        results.append(_check_one(it, engine, ours))
    return results


def _ours(ours: SourceTree, spec: str) -> inspect.Signature:
    mod, _, qual = spec.partition(":")
    found = ours.resolve((mod,), qual)
    if found is None or not isinstance(found[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"attnplug has no {spec}")
    return signature(found[1], method="." in qual)


def _check_one(it: Item, engine: SourceTree, ours: SourceTree) -> Result:
    if it.kind == "callsite":
        tree = engine.module(it.engine[0])
        sites = [
            c
            for c in (_call_sites(tree, it.name) if tree is not None else ())
            if not it.recv or (isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value).endswith(it.recv))
        ]
        if not sites:
            what = f"{it.recv}.{it.name}" if it.recv else it.name
            return Result(it, "", [f"no call of {what}(...) in {it.engine[0]} any more"] if it.required else [])
        sig, probs = _ours(ours, it.ours), []
        kinds = {p.kind for p in sig.parameters.values()}
        for c in sites:
            if any(isinstance(a, ast.Starred) for a in c.args):
                continue  # *args forwarding: the count is unknown
            if any(k.arg is None for k in c.keywords) and _P.VAR_KEYWORD not in kinds:
                probs.append(f"line {c.lineno}: engine passes **kwargs; attnplug's {it.ours}{fmt(sig)} has no **kwargs")
            try:
                sig.bind(*range(len(c.args)), **{k.arg: 0 for k in c.keywords if k.arg is not None})
            except TypeError as e:
                probs.append(
                    f"line {c.lineno}: engine calls with {len(c.args)} positional, keywords "
                    f"{[k.arg for k in c.keywords if k.arg]}; attnplug's {it.ours}{fmt(sig)}: {e}"
                )
        return Result(it, it.engine[0], probs)
    found = None
    for alt in it.name.split("|"):
        found = engine.resolve(it.engine, alt)
        if found:
            break
    if found is None:
        return Result(it, "", [f"{it.name} not found in {' / '.join(it.engine)}"] if it.required else [])
    mod, node = found
    is_fn = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    if it.kind == "override":
        if not is_fn:
            return Result(it, mod, [f"{it.name} is no longer a method"])
        eng, mine = signature(node), _ours(ours, it.ours)  # an override is a method
        return Result(it, mod, [f"{p} (engine {fmt(eng)}, attnplug {fmt(mine)})" for p in override_problems(eng, mine)])
    if it.kind == "call":
        if isinstance(node, ast.ClassDef):  # calling a class: its __init__
            init = engine.member(mod, node, "__init__")
            node = init[1] if init and isinstance(init[1], ast.FunctionDef) else None
            if node is None:
                return Result(it, mod, [] if it.npos == 0 and not it.kwargs else ["no __init__ to call"])
            eng = signature(node)
        elif not is_fn:
            return Result(it, mod, [f"{it.name} is not callable in the sources"])
        else:
            eng = signature(node, method="." in it.name.split("|")[0])
        return Result(it, mod, [f"{p} (engine {fmt(eng)})" for p in call_problems(eng, it.npos, it.kwargs, it.lead)])
    if it.kind == "const":
        v = _const_value(node)
        return Result(it, mod, [] if v == it.value else [f"{it.name} is {v!r}, attnplug expects {it.value!r}"])
    return Result(it, mod, [])  # attr: present


def report(results, engine_label: str) -> str:
    """One line per item: ``ok`` / ``MISSING`` / ``INCOMPATIBLE``, then the problems."""
    lines = []
    for r in results:
        status = "ok" if r.ok else ("MISSING" if not r.found else "INCOMPATIBLE")
        if r.ok and not r.found:
            status = "absent (optional)"
        lines.append(f"{engine_label}: {r.item.kind:9} {r.item.label}: {status}")
        lines += [f"    - {p}" for p in r.problems]
    return "\n".join(lines)


def problems(results) -> list[str]:
    return [f"{r.item.label}: {p}" for r in results for p in r.problems]


# -- engine versions and the refusal ------------------------------------------------------------------
def version_tuple(v: str) -> tuple:
    """``"0.5.23"`` -> ``(0, 5, 23)``; a part with a suffix (``"23rc1"``, ``"0+cpu"``) keeps its leading number."""
    out = []
    for part in v.split("+")[0].split("."):
        lead = ""
        for ch in part:
            if not ch.isdigit():
                break
            lead += ch
        if not lead:
            break
        out.append(int(lead))
        if lead != part:
            break
    if not out:
        raise ValueError(f"not a version: {v!r}")
    return tuple(out)


def in_range(v: str, lo: str, hi: str) -> bool:
    """``lo <= v <= hi`` on the first three version numbers (unparsable: False)."""
    try:
        return version_tuple(lo) <= version_tuple(v)[:3] <= version_tuple(hi)
    except ValueError:
        return False


def package_root(package: str) -> str:
    """The folder holding the installed top-level ``package`` (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    return os.path.dirname(list(spec.submodule_search_locations)[0]) if spec else ""


def attnplug_sources() -> SourceTree:
    """attnplug's own sources (the side ``override`` / ``callsite`` items are checked against)."""
    import attnplug

    return SourceTree(os.path.dirname(os.path.dirname(os.path.abspath(attnplug.__file__))))


def refusal(
    engine: str, package: str, version: str, tested: tuple[str, str], items, log, engine_root: str | None = None
) -> str | None:
    """``None`` when attnplug serves ``engine`` ``version``, else the user-facing reason.

    Inside ``tested`` (inclusive): ``None``, nothing checked. Outside: the installed sources (or
    ``engine_root``) are checked against ``items``; anything gone or changed refuses, naming
    attnplug, both versions and what changed; an unchanged interface is served with a warning."""
    import attnplug

    lo, hi = tested
    if in_range(version, lo, hi):
        return None
    found = problems(check(items, SourceTree(engine_root or package_root(package)), attnplug_sources()))
    if not found:
        log.warning(
            "attnplug %s: %s %s is outside the tested range %s..%s; its interface matches what attnplug "
            "relies on, so the backends are offered",
            attnplug.__version__,
            engine,
            version,
            lo,
            hi,
        )
        return None
    more = f" (and {len(found) - 6} more)" if len(found) > 6 else ""
    return (
        f"attnplug {attnplug.__version__}: {engine} {version} is outside the tested range {lo}..{hi} and its "
        f"attention-backend interface changed: {'; '.join(found[:6])}{more}. The attnplug backends are "
        f"refused; use {engine} {lo}..{hi} or an attnplug release that supports {engine} {version}"
    )
