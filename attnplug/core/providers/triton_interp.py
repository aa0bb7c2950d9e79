"""Triton's CPU interpreter without its repeated language patching (the triton provider on CPU).

The interpreter patches ``triton.language`` when a kernel launch starts (``GridExecutor.__call__``),
restores it when the launch ends, and patches again, without restoring, at every call of a nested
``@triton.jit`` helper (``InterpretedFunction.__call__``). Within one launch a re-patch of a module that
is already patched sets every attribute to an equivalent value. ``install()`` skips a nested patch
whose modules (``tl`` / ``tl.core`` seen from the helper's globals) were all patched earlier in the
same launch; any other patch runs as before. ``stats`` counts both. Installed for the triton versions
whose interpreter has been checked (``TESTED``) unless ``ATTNPLUG_TRITON_INTERP_MEMO=0``; otherwise the
interpreter runs unchanged.
"""

from __future__ import annotations

import inspect
import threading

from ..config import env_flag

stats = {"patched": 0, "skipped": 0}
enabled = True  # False: every patch runs (the interpreter's own behaviour), for comparisons
_local = threading.local()


TESTED = ((3, 7), (3, 8), (3, 9))


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` and ``GridExecutor.__call__``; False where
    ``ATTNPLUG_TRITON_INTERP_MEMO`` is off, this triton is not in ``TESTED`` or its interpreter lacks either
    (nothing is changed then). Idempotent."""
    if not env_flag("ATTNPLUG_TRITON_INTERP_MEMO", True):
        return False
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except Exception:
        return False
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) not in TESTED:
        return False
    patch, executor = getattr(interp, "_patch_lang", None), getattr(interp, "GridExecutor", None)
    if patch is None or executor is None or not hasattr(interp, "_LangPatchScope"):
        return False
    if getattr(patch, "_attnplug_memo", False):
        return True

    def langs_of(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def memo_patch_lang(fn):
        done = getattr(_local, "done", None)
        langs = langs_of(fn)
        if enabled and done is not None and langs and langs <= done:
            stats["skipped"] += 1
            return interp._LangPatchScope()
        stats["patched"] += 1
        scope = patch(fn)
        if done is not None:
            done |= langs
        return scope

    launch = executor.__call__

    def memo_call(self, *args, **kwargs):
        outer, _local.done = getattr(_local, "done", None), set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _local.done = outer

    memo_patch_lang._attnplug_memo = True
    interp._patch_lang = memo_patch_lang
    executor.__call__ = memo_call
    return True
