"""``AttnplugMLAAttnBackend``: attnplug's SGLang backends (``attnplug_*``) for MLA models (DeepSeek-V2/V3,
Kimi K2: ``model_config.attention_arch == MLA``, an ``MLATokenToKVPool``); the factory picks it by the model.

SGLang's DeepSeek attention chooses per forward, by backend name, between an MHA prefill (K/V up-projected
from the latent, no cache) and absorbed MLA (``AttentionBackendRegistry``; unknown names get triton's
choice). This backend registers its names there for absorbed MLA in every mode, so every forward runs
the core: ``attn_mqa`` calls ``forward_extend`` / ``forward_decode`` with

* ``q [T, H * (R + Dr)]`` = ``cat(q_nope @ W_UK, q_pe)`` per head, ``k [T, 1, R + Dr]`` the new tokens'
  latent rows (``cat(kv_c, k_pe)``), ``v`` their first ``R`` columns;
* the pool's per-layer buffer ``[slots, 1, R + Dr]`` viewed as pages ``[slots // P, P, R + Dr]``
  (``latent_cache_views``: V = its first ``R`` columns), written with the core's ``write_latent``;
* output ``[T, H * R]`` (SGLang applies ``W_UV``).

Plans, CUDA graphs (DECODE, TARGET_VERIFY) and cascade are the GQA backend's, with the MLA config
(``head_dim_v = R``). Refused at startup with attnplug's message: a provider without MLA or one that
cannot read the pool's dtype, DeepSeek-V3.2's sparse (DSA) pools and other MLA pool variants, EAGLE / MTP
draft models, and (should SGLang route one) the MHA prefill path.
"""

from __future__ import annotations

from . import compat
from .backend import AttnplugAttnBackend


class AttnplugMLAAttnBackend(AttnplugAttnBackend):
    """SGLang backend ``attnplug_<provider>`` on an MLA model; same arguments as :class:`AttnplugAttnBackend`."""

    def __init__(self, model_runner, backend_name: str = "attnplug_triton", provider: str | None = None):
        super().__init__(model_runner, backend_name, provider)
        if not compat.register_absorbed_mla_dispatch(backend_name):
            raise self.unsupported(
                "this SGLang's DeepSeek attention dispatch (no AttentionBackendRegistry to "
                "route MLA models to absorbed attention)"
            )

    def _pool_dims(self) -> tuple[int, int]:
        pool = self.token_to_kv_pool
        self.kv_lora_rank = int(pool.kv_lora_rank)
        return 1, int(pool.kv_lora_rank) + int(pool.qk_rope_head_dim)

    def _check_arch_and_pool(self, runner) -> None:
        if getattr(runner, "is_draft_worker", False):
            raise self.unsupported("EAGLE / MTP draft models with MLA")
        pool, pool_cls = self.token_to_kv_pool, compat.mla_pool_cls()
        if type(pool) is not pool_cls or getattr(pool, "use_dsa", False):
            raise self.unsupported(
                f"the MLA KV pool {type(pool).__name__}{' (DSA)' if getattr(pool, 'use_dsa', 0) else ''} "
                f"(only {pool_cls.__name__}: no sparse / DSA, fp4 or host-offloaded latent pools)"
            )
        if not self.provider.supports_mla():
            raise self.unsupported(f"MLA (multi-head latent attention) with provider '{self.provider_name}'")

    def graph_support(self):
        """The graph support of the provider's MLA class (``Provider.mla_class``), which runs every
        config of this backend; its GQA class's may differ."""
        return self.provider.mla_class().graph_support

    def _core_config(self, key: tuple):
        from attnplug.core import AttentionConfig

        hq, hkv, d, scale, cap, window, sinks = key
        return AttentionConfig(
            hq,
            hkv,
            d,
            self.page_size,
            self.dtype,
            "NHD",
            scale,
            cap,
            window,
            self.kv_dtype,
            sinks=sinks,
            head_dim_v=self.kv_lora_rank,
        )

    def _serves_layer(self, layer) -> bool:
        """The absorbed layers only (each DeepSeek layer also holds an MHA ``RadixAttention``)."""
        return layer.tp_k_head_num == 1 and layer.qk_head_dim == self.head_dim

    def _head_dim_v(self) -> int:
        return self.kv_lora_rank

    def _check_layer(self, layer, kwargs):
        if layer.tp_k_head_num != 1 or layer.qk_head_dim != self.head_dim:
            raise self.unsupported(
                f"layer {layer.layer_id}'s attention of {layer.tp_k_head_num} KV heads, head dims "
                f"{layer.qk_head_dim}/{layer.v_head_dim} on an MLA model (only absorbed MLA over the latent "
                f"cache: 1 head, {self.head_dim}/{self.kv_lora_rank}; e.g. SGLang's MHA prefill path)"
            )
        return super()._check_layer(layer, kwargs)

    def _scales(self, layer) -> dict:
        """fp8 latent pool: the layer's ``k_scale`` (one scale per latent row; MLA has no V scale)."""
        sc = super()._scales(layer)
        return {"k_scale": sc["k_scale"]} if sc else {}

    def _forward(self, q, k, v, layer, fb, save_kv_cache, kwargs):
        """``q [T, H * (R + Dr)]`` (absorbed), ``k [T, 1, R + Dr]`` (new latent rows) -> ``[T, H * R]``."""
        sinks = self._check_layer(layer, kwargs)
        if not self._metadata_ready():
            raise RuntimeError(f"attnplug: backend '{self.backend_name}': forward before init_forward_metadata")
        from attnplug.core.mla import latent_cache_views

        key = cfg = self.layer_config(layer, sinks is not None)
        cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(self.num_pages, self.page_size, self.head_dim)
        k_cache, v_cache = latent_cache_views(cache, cfg)
        scales = self._scales(layer)
        if save_kv_cache and k is not None:
            self._write_latent(layer, fb, k, v, cache, scales)
        hq = layer.tp_q_head_num
        q3 = q.reshape(-1, hq, self.head_dim)
        out = q3.new_empty(q3.shape[0], hq, self.kv_lora_rank)
        self._run(key, q3, k_cache, v_cache, out, scales)
        self._stats.layer_runs += 1
        return out.view(-1, hq * self.kv_lora_rank)

    def _write_latent(self, layer, fb, k, v, cache, scales: dict) -> None:
        """The new tokens' latent rows ``k [T, 1, R + Dr]`` into the pool at ``out_cache_loc``: the core's
        one-launch ``write_latent`` where Triton runs (fp8: quantized by ``k_scale``), else SGLang's
        ``set_kv_buffer`` (unquantized pools)."""
        from attnplug.core.providers.triton import triton_runs_on

        rows = k.reshape(k.shape[0], self.head_dim)
        if triton_runs_on(cache):
            from attnplug.core.mla import write_latent

            R = self.kv_lora_rank
            write_latent(rows[:, :R], rows[:, R:], cache, fb.out_cache_loc, scales.get("k_scale"))
        elif scales:
            raise self.unsupported("an fp8 latent pool without Triton (the quantizing write is a Triton kernel)")
        else:
            self.token_to_kv_pool.set_kv_buffer(layer, compat.write_loc(fb), k, v)
