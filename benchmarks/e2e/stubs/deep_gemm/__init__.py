"""Stand-in for DeepGEMM on the offline H200 (the SGLang bundle lacks it): SGLang 0.5.17's EAGLE
graph capture imports ``deep_gemm`` at module level through its sparse-attention backend
(``sglang/srt/layers/attention/dsa_backend.py``), whose kernels a Llama model never calls. Every
name resolves to a function that raises, so a call fails loudly instead of computing anything."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise RuntimeError(
            f"deep_gemm.{name} called, but deep_gemm here is attnplug's e2e import stand-in "
            "(benchmarks/e2e/stubs): install DeepGEMM for models that use it"
        )

    missing.__name__ = name
    return missing
