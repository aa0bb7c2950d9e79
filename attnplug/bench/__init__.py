"""attnplug benchmark: ``python -m attnplug.bench`` (see ``__main__``).

Modules: ``workloads`` (rows, inputs, reference), ``impls`` (what is timed), ``timing`` (median
CUDA-event timer, copy / matmul ceilings), ``report`` (JSON, markdown, PNG), ``jit_warmup``
(pre-builds FlashInfer's JIT kernels in one parallel ninja run).
"""
