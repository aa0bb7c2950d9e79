"""Subprocess driver of ``test_gptoss_gate_sglang.py``: resolves SGLang's ``ServerArgs`` for the model
in ``argv[1]`` with several attention backends, first with attnplug's names only added to the CLI
choices (no hooks), then after ``load_plugins()``; prints ``RESULT {case: outcome}`` as JSON."""

import json
import sys

from sglang.srt.server_args import prepare_server_args

from attnplug.sglang_adapter import BACKENDS, compat

model = sys.argv[1]


def resolve(*flags):
    try:
        sa = prepare_server_args(["--model-path", model, "--device", "cpu", *flags])
        if hasattr(sa, "resolve_once"):
            sa.resolve_once()
    except BaseException as e:
        return {"error": f"{type(e).__name__}: {e}"}
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_server_args(sa)
    return {
        "hybrid_swa": mc.is_hybrid_swa,
        "resolved": {
            k: v for k, v in sa.resolved_dict().items() if k in ("disable_hybrid_swa_memory", "attention_backend")
        }
        if hasattr(sa, "resolved_dict")
        else sa.disable_hybrid_swa_memory,
        "backends": [sa.attention_backend, sa.prefill_attention_backend, sa.decode_attention_backend],
    }


out = {}
compat.add_attention_backend_choices(list(BACKENDS))
out["no_hook"] = resolve("--attention-backend", "attnplug_triton")
from sglang.srt.plugins import load_plugins

load_plugins()
out["attnplug"] = resolve("--attention-backend", "attnplug_triton")
out["decode_only"] = resolve("--prefill-attention-backend", "triton", "--decode-attention-backend", "attnplug_fa3")
out["triton"] = resolve("--attention-backend", "triton")
out["torch_native"] = resolve("--attention-backend", "torch_native")
print("RESULT", json.dumps(out))
