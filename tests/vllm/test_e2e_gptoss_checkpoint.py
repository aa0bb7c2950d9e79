"""benchmarks/e2e/make_model.py --gpt-oss (the GPU end-to-end model of issue 41), shrunk: the checkpoint it writes
loads into transformers' GptOssForCausalLM with no missing or unexpected weight, its layers alternate window and
full attention, and its sinks are logits of a few units."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "e2e"))
import make_model  # noqa: E402


def test_gpt_oss_checkpoint_loads_whole(tmp_path):
    from transformers import GptOssForCausalLM

    n = 3
    cfg = dict(
        make_model.GPT_OSS_20B,
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        vocab_size=300,
        num_hidden_layers=n,
        layer_types=[("sliding_attention", "full_attention")[k % 2] for k in range(n)],
    )
    make_model.write(str(tmp_path), cfg)
    model, info = GptOssForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert model.config.sliding_window == 128 and model.config.head_dim == 64
    sinks = torch.stack([layer.self_attn.sinks.float() for layer in model.model.layers])
    assert sinks.shape == (n, 64) and 1.5 < sinks.std().item() < 6.0
    biases = model.model.layers[0].self_attn.q_proj.bias
    assert biases.abs().max() > 0
    out = model(torch.tensor([[3, 4, 5, 6]])).logits
    assert torch.isfinite(out).all()
