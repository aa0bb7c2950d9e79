"""TEST-ONLY CPU stand-in for ``sgl_kernel`` (whose wheel is CUDA-only). NOT part of attnplug.

Lives in ``tests/sglang/sgl_kernel_shim`` and is put on ``PYTHONPATH`` by the SGLang tests only, so
that ``import sglang`` works on a CPU-only machine: SGLang imports a few ``sgl_kernel`` names at
module level when ``SGLANG_USE_CPU_ENGINE=1``. Every name (and every submodule) resolves to a stub
that raises when called; the CPU code paths the tests use never call one.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+attnplug-test-shim"
ATTNPLUG_TEST_SHIM = True


class _Stub:
    """Any attribute is another stub; calling one raises (a real kernel was needed)."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a stub of the test-only sgl_kernel shim (attnplug tests)")

    def __repr__(self):
        return f"<sgl_kernel shim stub {self._name}>"


def _module_getattr(modname):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{modname}.{attr}")

    return __getattr__


__getattr__ = _module_getattr("sgl_kernel")


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sgl_kernel.<sub>`` module as a stub module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        pass


if not any(isinstance(f, _ShimFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShimFinder())
