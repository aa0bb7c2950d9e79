"""Write a Llama-3-8B-shaped checkpoint with random weights whose attention is NOT uniform.

Engines' dummy loaders draw weights in +-1e-3, which makes every attention row nearly uniform and
every backend agree trivially. Here every matrix is N(0, 0.02) (the HF initializer range) and the
norms are 1: after RMSNorm the q/k entries have std ~1.3, so attention logits have std ~1.6 -
peaked rows, where a wrong mask, page or scale changes tokens.

    python benchmarks/e2e/make_model.py /tmp/llama8b-rand [--layers 32] [--eagle-draft /tmp/eagle-draft]
    python benchmarks/e2e/make_model.py /tmp/dsv2-rand --deepseek-v2 [--layers 8]    # MLA (issue 45)
    python benchmarks/e2e/make_model.py /tmp/gptoss-rand --gpt-oss [--layers 4]      # sinks (issue 41)

``--deepseek-v2``: DeepSeek-V2's attention (MLA: 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128 +
rope 64, v 128; hidden 5120) with dense MLP layers only (``first_k_dense_replace`` = the layer count: no MoE
library needed), cut to ``--layers``. ``q_b_proj`` / ``kv_b_proj`` are drawn wider (:data:`STD`) so that
the up-projected q / k entries have std ~1.2 after the latent norms and the attention logits std ~1.5.

``--gpt-oss``: gpt-oss-20b's shapes (64 query / 8 KV heads of 64, a sink logit a query head, layers alternating
a 128-token window and full attention, 32 experts, top 4), bf16 and unquantized (no ``quantization_config``: the
engines' unquantized MoE path), cut to ``--layers``. The sinks are drawn with std :data:`SINK_STD`: logits of a
few units, where a sink counted twice or dropped changes tokens.

Weights are drawn on the GPU (seeded, one generator), written as safetensors shards
(``model-0000i-of-0000n.safetensors`` + index). The EAGLE draft directory (one folder an engine) gets a
config and the weights of a *repeat-last-token* head (:func:`eagle_repeat_weights`): ``fc = [0 | I]``
passes the target's hidden state through, the layer adds nothing (zero projections), and the target's
shared ``lm_head`` then proposes the token the target has just emitted. Drafts are accepted wherever
the target repeats a token (its greedy continuation cycling with period 1: ``--prompts cycle``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
}


DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 8,
    "n_routed_experts": 160,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "hidden_act": "silu",
    "vocab_size": 102400,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "attention_bias": True,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
}
#: per-matrix std where the initializer range would leave MLA's attention near uniform
STD = {"q_b_proj": 0.03, "kv_b_proj": 0.05}
#: gpt-oss's sink logits (``self_attn.sinks``, one a query head)
SINK_STD = 3.0


def tensors(cfg: dict):
    """Yield (name, shape) of a Llama (or, by ``model_type``, a dense DeepSeek-V2 or a gpt-oss) checkpoint in HF
    naming: each layer's attention and MLP weights from :data:`LAYER_PARTS`."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    attention, mlp = LAYER_PARTS.get(cfg.get("model_type"), (gqa_tensors, dense_mlp_tensors))
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,)
        yield from ((p + "self_attn." + n, shape) for n, shape in attention(cfg))
        yield p + "post_attention_layernorm.weight", (h,)
        yield from ((p + "mlp." + n, shape) for n, shape in mlp(cfg))
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def dense_mlp_tensors(cfg: dict):
    """A dense SwiGLU MLP's weights: (name under ``mlp.``, shape)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    return [("gate_proj.weight", (i, h)), ("up_proj.weight", (i, h)), ("down_proj.weight", (h, i))]


def gqa_tensors(cfg: dict):
    """A Llama layer's attention weights: (name under ``self_attn.``, shape)."""
    h, d, hq, hk = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return [
        ("q_proj.weight", (hq * d, h)),
        ("k_proj.weight", (hk * d, h)),
        ("v_proj.weight", (hk * d, h)),
        ("o_proj.weight", (h, hq * d)),
    ]


def gpt_oss_attention_tensors(cfg: dict):
    """A gpt-oss layer's attention weights (name under ``self_attn.``, shape): ``sinks [Hq]`` and biased GQA
    projections."""
    biased = [(n, shape) for w, shape in gqa_tensors(cfg) for n in (w, w.replace("weight", "bias"))]
    return [("sinks", (cfg["num_attention_heads"],))] + [(n, s if n.endswith("weight") else s[:1]) for n, s in biased]


def moe_mlp_tensors(cfg: dict):
    """A gpt-oss layer's MoE weights (bf16, unquantized; name under ``mlp.``, shape): the router and the fused
    experts (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, their biases)."""
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    return [
        ("router.weight", (e, h)),
        ("router.bias", (e,)),
        ("experts.gate_up_proj", (e, h, 2 * i)),
        ("experts.gate_up_proj_bias", (e, 2 * i)),
        ("experts.down_proj", (e, i, h)),
        ("experts.down_proj_bias", (e, h)),
    ]


def mla_tensors(cfg: dict):
    """A DeepSeek-V2 layer's MLA weights: (name under ``self_attn.``, shape)."""
    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    ql, kl, dn, dr, dv = (
        cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    return [
        ("q_a_proj.weight", (ql, h)),
        ("q_a_layernorm.weight", (ql,)),
        ("q_b_proj.weight", (hq * (dn + dr), ql)),
        ("kv_a_proj_with_mqa.weight", (kl + dr, h)),
        ("kv_a_layernorm.weight", (kl,)),
        ("kv_b_proj.weight", (hq * (dn + dv), kl)),
        ("o_proj.weight", (h, hq * dv)),
    ]


#: each ``model_type``'s (attention, MLP) weight lists; others: Llama's
LAYER_PARTS = {
    "deepseek_v2": (mla_tensors, dense_mlp_tensors),
    "gpt_oss": (gpt_oss_attention_tensors, moe_mlp_tensors),
}


def write(path: str, cfg: dict, seed: int = 0, shard_bytes: int = 4 << 30) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415 - the GPU machine's engines bring it

    os.makedirs(path, exist_ok=True)
    stamp = os.path.join(path, "attnplug_random.json")
    if os.path.exists(stamp) and json.load(open(stamp)) == {"seed": seed, **cfg}:
        print(f"make_model: {path} exists", flush=True)
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    std = cfg["initializer_range"]
    shards, cur, size = [], {}, 0
    for name, shape in tensors(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            sd = SINK_STD if name.endswith(".sinks") else next((x for k, x in STD.items() if f".{k}." in name), std)
            t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * sd).to(torch.bfloat16).cpu()
        cur[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            index["weight_map"][name] = fname
            index["metadata"]["total_size"] += t.numel() * 2
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"), indent=1)
    json.dump(
        {k: v for k, v in cfg.items() if k != "initializer_range"},
        open(os.path.join(path, "config.json"), "w"),
        indent=1,
    )
    json.dump({"seed": seed, **cfg}, open(stamp, "w"))


#: The EAGLE(-1) Llama draft head's architecture name in each engine's model registry.
EAGLE_ARCH = {"sglang": "LlamaForCausalLMEagle", "vllm": "EagleLlamaForCausalLM"}


def eagle_repeat_weights(target: dict, engine: str) -> dict[str, torch.Tensor]:
    """An EAGLE(-1) Llama head (``fc [H, 2H]`` on ``cat(embed(token), hidden)``, one decoder layer, the
    target's embedding and ``lm_head`` shared) that returns the target's hidden state unchanged: ``fc = [0 |
    I]``, every projection of the layer zero (attention and MLP add 0 to the residual), norms 1. Its logits
    are the target's at the previous position: it proposes the last emitted token again. Names as the
    engines' loaders read them (``model.`` is prefixed by them); SGLang's ``fc`` has a bias (zero), vLLM's
    layer 0 has no ``input_layernorm``."""
    h, i = target["hidden_size"], target["intermediate_size"]
    d, hq, hk = target["head_dim"], target["num_attention_heads"], target["num_key_value_heads"]
    bf = torch.bfloat16
    fc = torch.zeros(h, 2 * h, dtype=bf)
    fc[:, h:] = torch.eye(h, dtype=bf)
    w = {"fc.weight": fc}
    shapes = {
        "self_attn.q_proj": (hq * d, h),
        "self_attn.k_proj": (hk * d, h),
        "self_attn.v_proj": (hk * d, h),
        "self_attn.o_proj": (h, hq * d),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    w.update({f"layers.0.{k}.weight": torch.zeros(shape, dtype=bf) for k, shape in shapes.items()})
    w["layers.0.post_attention_layernorm.weight"] = torch.ones(h, dtype=bf)
    if engine == "sglang":
        w["fc.bias"] = torch.zeros(h, dtype=bf)
        w["layers.0.input_layernorm.weight"] = torch.ones(h, dtype=bf)  # skipped by SGLang's layer 0
    return w


def write_eagle_draft(path: str, target: dict, weights: bool = True) -> None:
    """A one-layer EAGLE(-1) draft head for ``target``, one folder an engine: ``path/sglang`` and
    ``path/vllm`` (:data:`EAGLE_ARCH`: the engines name the class differently), each with its config and
    (``weights``) :func:`eagle_repeat_weights` as ``model.safetensors``."""
    from safetensors.torch import save_file  # noqa: PLC0415

    cfg = {k: v for k, v in target.items() if k != "initializer_range"}
    for engine, arch in EAGLE_ARCH.items():
        os.makedirs(os.path.join(path, engine), exist_ok=True)
        cfg.update(architectures=[arch], num_hidden_layers=1)
        json.dump(cfg, open(os.path.join(path, engine, "config.json"), "w"), indent=1)
        if weights:
            save_file(
                eagle_repeat_weights(cfg, engine),
                os.path.join(path, engine, "model.safetensors"),
                metadata={"format": "pt"},
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=None, help="default: 32 (Llama), 8 (--deepseek-v2), 4 (--gpt-oss)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eagle-draft", default=None)
    ap.add_argument("--deepseek-v2", action="store_true", help="a dense DeepSeek-V2 (MLA) instead of Llama-3-8B")
    ap.add_argument("--gpt-oss", action="store_true", help="a gpt-oss-20b-shaped model (sinks, windows, bf16 MoE)")
    a = ap.parse_args()
    if a.gpt_oss:
        n = a.layers or GPT_OSS_20B["num_hidden_layers"]
        cfg = dict(
            GPT_OSS_20B,
            num_hidden_layers=n,
            layer_types=[("sliding_attention", "full_attention")[k % 2] for k in range(n)],
        )
    elif a.deepseek_v2:
        n = a.layers or DEEPSEEK_V2["num_hidden_layers"]
        cfg = dict(DEEPSEEK_V2, num_hidden_layers=n, first_k_dense_replace=n)
    else:
        cfg = dict(LLAMA3_8B, num_hidden_layers=a.layers or 32)
    t = time.time()
    write(a.path, cfg, a.seed)
    if a.eagle_draft:
        write_eagle_draft(a.eagle_draft, cfg)
    print(f"make_model: wrote {a.path} in {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
