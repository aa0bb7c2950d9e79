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
(``head_dim_v = R``).

Prefill as SGLang's fa3 backend runs it, where the provider has a cache-free prefill for the model's
up-projected head dims (:mod:`attnplug.core.ragged`; DeepSeek: qk 192 / v 128): the registered dispatch
sends an extend without a cached prefix, or with one that fits SGLang's one-shot pass, to the MHA layer
(``attn_mha``: ``q [T, H, 192]``, ``k [Tk, H, 192]``, ``v [Tk, H, 128]``, each request's keys its whole
sequence, request-major) -> ``[T, H * 128]``; everything else runs absorbed. Without such a prefill (a
provider or FA3 build without one), or on an fp8 latent pool, every mode runs absorbed; the startup log says
which.

Refused at startup with attnplug's message: a provider without MLA or one that cannot read the pool's
dtype, DeepSeek-V3.2's sparse (DSA) pools and other MLA pool variants, EAGLE / MTP draft models.
"""

from __future__ import annotations

import logging

from attnplug.core import ProviderUnavailable, UnsupportedFeature

from . import compat
from .backend import AttnplugAttnBackend, passed_args

logger = logging.getLogger(__name__)


class AttnplugMLAAttnBackend(AttnplugAttnBackend):
    """SGLang backend ``attnplug_<provider>`` on an MLA model; same arguments as :class:`AttnplugAttnBackend`."""

    def __init__(self, model_runner, backend_name: str = "attnplug_triton", provider: str | None = None):
        super().__init__(model_runner, backend_name, provider)
        self._ragged: dict[tuple, object] = {}  # (Hq, Hkv, D, Dv, scale) -> RaggedAttention
        self._ragged_planned: dict[tuple, int] = {}  # its forward id
        self.mha_prefill = self._mha_prefill_refusal(model_runner) is None
        if not compat.register_mla_dispatch(backend_name, self.mha_prefill):
            raise self.unsupported(
                "this SGLang's DeepSeek attention dispatch (no AttentionBackendRegistry to "
                "route MLA models to attnplug's attention)"
            )

    def _mha_prefill_dims(self, runner) -> tuple[int, int] | None:
        """``(qk, v)`` head dims of the model's up-projected prefill (DeepSeek: 128 + 64, 128), or ``None``."""
        hf = getattr(runner.model_config, "hf_text_config", None)
        nope, rope, v = (getattr(hf, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if not all(isinstance(x, int) and x > 0 for x in (nope, rope, v)):
            return None
        return nope + rope, v

    def _mha_prefill_refusal(self, runner) -> str | None:
        """Why the prefill runs absorbed (logged), or ``None``: the provider's cache-free prefill serves the
        model's MHA prefill (built once here, so a refusal shows at startup)."""
        from attnplug.core import RaggedAttention, RaggedConfig

        dims = self._mha_prefill_dims(runner)
        if dims is None:
            why = "the model config names no qk_nope / qk_rope / v head dims"
        elif self.kv_dtype != self.dtype:
            why = "an fp8 latent pool: SGLang's MHA prefill writes its latents unscaled, attnplug's write scales them"
        else:
            h = self.num_qo_heads
            try:
                RaggedAttention(RaggedConfig(h, h, dims[0], dims[1], self.dtype), self.provider, self.device)
                why = None
            except (UnsupportedFeature, ProviderUnavailable, ValueError) as e:
                why = str(e).removeprefix("attnplug: ")
        logger.info(
            "attnplug: %s on an MLA model: prefill %s",
            self.backend_name,
            f"as SGLang's fa3 chooses it, MHA over up-projected K/V (head dims {dims[0]}/{dims[1]}) "
            "through the provider's ragged prefill"
            if why is None
            else f"absorbed in every mode ({why})",
        )
        return why

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
                f"cache: 1 head, {self.head_dim}/{self.kv_lora_rank}"
                + ("" if self.mha_prefill else "; SGLang's MHA prefill path: the provider has no ragged prefill")
                + ")"
            )
        return super()._check_layer(layer, kwargs)

    def _is_mha_prefill(self, layer, fb) -> bool:
        """``layer`` is the MHA prefill's (``attn_mha``) of an extend this backend runs that way."""
        return (
            self.mha_prefill
            and not self._serves_layer(layer)
            and fb.forward_mode.is_extend_without_speculative()
            and layer.tp_k_head_num == layer.tp_q_head_num
        )

    def _forward_mha_prefill(self, q, k, v, layer, fb, kwargs):
        """SGLang's MHA prefill: ``q [T, H*Dqk]`` (or ``[T, H, Dqk]``), ``k [Tk, H, Dqk]``, ``v [Tk, H, Dv]``
        (every token of each request's sequence, request-major) -> ``[T, H * Dv]``."""
        extra = passed_args(kwargs)
        if extra:
            raise self.unsupported(f"attention arguments {extra} on the MHA prefill")
        from attnplug.core import RaggedAttention, RaggedConfig

        hq, hkv, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        key = (hq, hkv, d, dv, float(layer.scaling))
        attn = self._ragged.get(key)
        if attn is None:
            try:
                attn = RaggedAttention(RaggedConfig(*key[:4], self.dtype, key[4]), self.provider, self.device)
            except (UnsupportedFeature, ValueError) as e:
                raise self.unsupported(f"SGLang's MHA prefill here ({str(e).removeprefix('attnplug: ')})") from e
            self._ragged[key] = attn
        if self._ragged_planned.get(key) != self._forward_id:
            qo, kv = list(fb.extend_seq_lens_cpu), [int(x) for x in fb.seq_lens_cpu]
            if k.shape[0] != sum(kv):
                raise RuntimeError(
                    f"attnplug: backend '{self.backend_name}': the MHA prefill got {k.shape[0]} key rows, not the "
                    f"{sum(kv)} of the batch's sequences (a prefix-chunked MHA pass, which attnplug's dispatch "
                    "does not choose)"
                )
            attn.plan(qo, kv)
            self._ragged_planned[key] = self._forward_id
        out = attn.run(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, dv))
        self._stats.layer_runs += 1
        return out.view(-1, hq * dv)

    def _scales(self, layer) -> dict:
        """fp8 latent pool: the layer's ``k_scale`` (one scale per latent row; MLA has no V scale)."""
        sc = super()._scales(layer)
        return {"k_scale": sc["k_scale"]} if sc else {}

    def _forward(self, q, k, v, layer, fb, save_kv_cache, kwargs):
        """``q [T, H * (R + Dr)]`` (absorbed), ``k [T, 1, R + Dr]`` (new latent rows) -> ``[T, H * R]``; the
        MHA prefill's layer: :meth:`_forward_mha_prefill`."""
        if self._is_mha_prefill(layer, fb):
            return self._forward_mha_prefill(q, k, v, layer, fb, kwargs)
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
