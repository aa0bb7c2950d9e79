"""Hash every attnplug Triton kernel the way Triton does before a compile (``JITFunction.cache_key``:
it walks the kernel's body and refuses globals it cannot call inside a kernel), after an engine has
patched ``triton``. No GPU needed; run without ``TRITON_INTERPRET`` (the interpreter never hashes).

    python tests/kernel_hash_check.py plain            # triton as installed
    python tests/kernel_hash_check.py sglang-patch     # SGLang 0.5.17's setattr(triton, "next_power_of_2", ...)
    python tests/kernel_hash_check.py import:MODULE    # import MODULE first (e.g. the engine's own)

Prints ``seen N`` (kernels hashed) and one line per failing kernel; exit 1 when any fails or none seen.
"""

import importlib
import pkgutil
import sys

import triton
from triton.runtime.jit import JITFunction

mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
if mode == "sglang-patch":  # as sglang/srt/utils/common.py does at import

    def next_power_of_2(n: int):
        return 1 << (n - 1).bit_length() if n > 0 else 1

    triton.next_power_of_2 = next_power_of_2
elif mode.startswith("import:"):
    importlib.import_module(mode.split(":", 1)[1])
    print("triton.next_power_of_2 from", getattr(triton.next_power_of_2, "__module__", "?"))

import attnplug.core.kernels as pkg  # noqa: E402

seen, failed = 0, []
for m in pkgutil.iter_modules(pkg.__path__):
    mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
    for name, obj in vars(mod).items():
        if isinstance(obj, JITFunction) and obj.__module__ == mod.__name__:
            seen += 1
            try:
                _ = obj.cache_key
            except Exception as e:  # noqa: BLE001 - reported, the exit code fails the caller
                failed.append(f"{mod.__name__}.{name}: {e}")
print("seen", seen)
print("\n".join(failed))
sys.exit(1 if failed or seen == 0 else 0)
