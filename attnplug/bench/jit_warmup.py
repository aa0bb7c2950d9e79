"""Pre-build FlashInfer's JIT kernels in one parallel ninja run: ``python -m attnplug.bench.jit_warmup``.

FlashInfer compiles each (backend, dtype, head_dim, sliding window, soft cap) variant of its paged
prefill module (also used by tensor-core decode) on first use, one module at a time. Building all
the variants the GPU tests and the benchmark need in one ``build_jit_specs`` call keeps every CPU
busy; run it in the background while the triton / fa3 tests run, then run the flashinfer tests.

    --full   also the fa3 template for every variant (what ATTNPLUG_GPU_TESTS_FULL=1 uses)
    --bench  the first batch only (the benchmark's d128 bf16 and fp8 e4m3 rows, cascade)
"""

from __future__ import annotations

import sys
import time

import torch


def specs(full: bool = False) -> list[list]:
    """Two batches: what the benchmark and most tests need (base bf16/d128 fa2 + fa3, cascade,
    packbits, bf16 + fp8 e4m3 KV), then the test variants (fp16/d64, soft cap, sliding window, the
    other fp8 KV dtypes), the benchmark's bf16 d64 / d256 rows (fa2 + fa3) and the MLA ragged prefill's 192 / 128."""
    from flashinfer.jit import gen_batch_prefill_module  # noqa: PLC0415
    from flashinfer.jit.cascade import gen_cascade_module  # noqa: PLC0415
    from flashinfer.jit.quantization import gen_quantization_module  # noqa: PLC0415

    sm90 = torch.cuda.get_device_capability()[0] == 9
    bf16, fp16 = torch.bfloat16, torch.float16
    # (dtype, qk head dim, vo head dim, sliding window, soft cap, with the fa3 template by default)
    variants = [
        (bf16, 128, 128, False, False, True),
        (fp16, 64, 64, False, False, False),
        (bf16, 128, 128, False, True, False),
        (bf16, 128, 128, True, False, False),
        (bf16, 64, 64, False, False, True),
        (bf16, 256, 256, False, False, True),  # the bench's d64 / d256 rows
        (bf16, 192, 128, False, False, True),  # the ragged prefill of MLA models (SGLang's MHA prefill)
    ]
    out = [[gen_cascade_module(), gen_quantization_module()], []]
    for i, (dt, d, dv, swa, cap, fa3) in enumerate(variants):
        for backend in ("fa2", "fa3") if sm90 and (fa3 or full) else ("fa2",):
            out[min(i, 1)].append(gen_batch_prefill_module(backend, dt, dt, dt, torch.int32, d, dv, 0, swa, cap, False))
    # fp8 KV (issue 15): q / out in the model dtype, K/V e4m3 or e5m2, fa2 template (decode and prefill);
    # bf16 + e4m3 d128 is the benchmark's, all four the GPU tests' (tests/gpu/test_fp8_gpu.py)
    for dt, kv in (
        (bf16, torch.float8_e4m3fn),
        (bf16, torch.float8_e5m2),
        (fp16, torch.float8_e4m3fn),
        (fp16, torch.float8_e5m2),
    ):
        out[0 if (dt, kv) == (bf16, torch.float8_e4m3fn) else 1].append(
            gen_batch_prefill_module("fa2", dt, kv, dt, torch.int32, 128, 128, 0, False, False, False)
        )
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    t0 = time.time()
    try:
        from flashinfer.jit import build_jit_specs  # noqa: PLC0415

        batches = specs(full="--full" in argv)
        for batch in batches[:1] if "--bench" in argv else batches:
            print(f"jit_warmup: building {[x.name for x in batch]}", flush=True)
            build_jit_specs(batch, verbose=False)
            print(f"jit_warmup: built {len(batch)} modules at {time.time() - t0:.0f}s", flush=True)
    except Exception as e:  # never fatal: the kernels then build on first use
        print(f"jit_warmup: failed after {time.time() - t0:.0f}s: {e!r}", flush=True)
        return 1
    print(f"jit_warmup: done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
