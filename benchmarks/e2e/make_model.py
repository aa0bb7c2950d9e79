"""Write a Llama-3-8B-shaped checkpoint with random weights whose attention is NOT uniform.

Engines' dummy loaders draw weights in +-1e-3, which makes every attention row nearly uniform and
every backend agree trivially. Here every matrix is N(0, 0.02) (the HF initializer range) and the
norms are 1: after RMSNorm the q/k entries have std ~1.3, so attention logits have std ~1.6 -
peaked rows, where a wrong mask, page or scale changes tokens.

    python benchmarks/e2e/make_model.py /tmp/llama8b-rand [--layers 32] [--eagle-draft /tmp/eagle-draft]

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
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
}


def tensors(cfg: dict):
    """Yield (name, shape) of a Llama checkpoint in HF naming."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, hq, hk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (hq * d, h)
        yield p + "self_attn.k_proj.weight", (hk * d, h)
        yield p + "self_attn.v_proj.weight", (hk * d, h)
        yield p + "self_attn.o_proj.weight", (h, hq * d)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


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
            t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * std).to(torch.bfloat16).cpu()
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
    json.dump({k: v for k, v in cfg.items() if k != "initializer_range"}, open(os.path.join(path, "config.json"), "w"), indent=1)
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
    shapes = {"self_attn.q_proj": (hq * d, h), "self_attn.k_proj": (hk * d, h), "self_attn.v_proj": (hk * d, h),
              "self_attn.o_proj": (h, hq * d), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
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
            save_file(eagle_repeat_weights(cfg, engine), os.path.join(path, engine, "model.safetensors"),
                      metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eagle-draft", default=None)
    a = ap.parse_args()
    cfg = dict(LLAMA3_8B, num_hidden_layers=a.layers)
    t = time.time()
    write(a.path, cfg, a.seed)
    if a.eagle_draft:
        write_eagle_draft(a.eagle_draft, cfg)
    print(f"make_model: wrote {a.path} in {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
