"""Helpers of the SGLang tests: subprocess env, hand-built SGLang pools / batches, a dense oracle."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIM = HERE / "sgl_kernel_shim"


def subprocess_env(**extra: str) -> dict[str, str]:
    """Env for SGLang subprocesses: test-only shim on PYTHONPATH, CPU engine, offline.

    TRITON_INTERPRET is removed on purpose: attnplug_triton must switch it on by itself on CPU.
    """
    drop = ("TRITON_INTERPRET", "ATTNPLUG_MARKER_DIR", "ATTNPLUG_PROVIDER_OVERRIDE", "SGLANG_PLUGINS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


# -- hand-built SGLang objects ----------------------------------------------------------------------
HQ, HKV, D = 4, 2, 64


def make_runner(page_size: int, *, num_slots: int = 1024, layers: int = 2, dtype=torch.float32, **over):
    """A ModelRunner stand-in holding SGLang's real pools (ReqToTokenPool, MHATokenToKVPool) and translator."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    r2t = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=num_slots,
        page_size=page_size,
        dtype=dtype,
        head_num=HKV,
        head_dim=D,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    try:  # SGLang 0.5.23; 0.5.17 has no translator (ModelRunner has no kv_index_translator)
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    except ImportError:
        tr = None
    else:
        tr = KVIndexTranslator(
            req_to_token=r2t.req_to_token,
            token_to_kv_pool_allocator=None,
            token_to_kv_pool=kv,
            page_size=page_size,
            device="cpu",
        )
    mc = SimpleNamespace(
        is_encoder_decoder=False,
        attention_arch=AttentionArch.MHA,
        dtype=dtype,
        get_num_attention_heads=lambda tp: HQ // tp,
    )
    runner = SimpleNamespace(
        device="cpu",
        page_size=page_size,
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
        kv_index_translator=tr,
        model_config=mc,
        dtype=dtype,
        kv_cache_dtype=dtype,
        is_draft_worker=False,
    )
    for k, v in over.items():
        setattr(runner, k, v)
    return runner


def make_layer(layer_id: int = 0, **over):
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(num_heads=HQ, head_dim=D, scaling=D**-0.5, num_kv_heads=HKV, layer_id=layer_id)
    for k, v in over.items():
        setattr(layer, k, v)
    return layer


class Requests:
    """Requests living in the runner's pools: page-aligned random slots, cached prefix KV filled in.

    ``kv_lens[b]`` tokens are allocated per request; the first ``prefix[b]`` already hold KV.
    """

    def __init__(self, runner, kv_lens: list[int], prefix: list[int], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.runner, self.kv_lens, self.prefix = runner, list(kv_lens), list(prefix)
        P = runner.page_size
        pool = runner.token_to_kv_pool
        num_pages = (pool.size + P) // P
        need = [-(-n // P) for n in kv_lens]
        pages = (torch.randperm(num_pages - 1, generator=g)[: sum(need)] + 1).tolist()  # page 0 = padding
        self.rows = torch.arange(1, len(kv_lens) + 1, dtype=torch.int64)
        self.slots = []
        for b, n in enumerate(kv_lens):
            mine, pages = pages[: need[b]], pages[need[b] :]
            t = torch.arange(n)
            slots = torch.tensor(mine)[t // P] * P + t % P
            runner.req_to_token_pool.req_to_token[self.rows[b], :n] = slots.to(torch.int32)
            self.slots.append(slots)
        for layer_id in range(pool.layer_num):
            for b, p in enumerate(prefix):
                self.fill(pool, layer_id, self.slots[b][:p], g)

    def fill(self, pool, layer_id: int, slots, g) -> None:
        """Random cached KV at ``slots`` of layer ``layer_id``."""
        pool.get_key_buffer(layer_id)[slots] = torch.randn(len(slots), HKV, D, generator=g)
        pool.get_value_buffer(layer_id)[slots] = torch.randn(len(slots), HKV, D, generator=g)

    def batch(self, mode, q_lens: list[int], lens: list[int] | None = None, spec_info=None):
        """A ForwardBatch stand-in over the first ``lens[b]`` (default: all) tokens of each request,
        the last ``q_lens[b]`` of which are new. For TARGET_VERIFY, SGLang's ``seq_lens`` exclude
        the draft tokens (which follow them)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        lens = list(lens or self.kv_lens)
        verify = mode == ForwardMode.TARGET_VERIFY
        seq = [n - (q if verify else 0) for n, q in zip(lens, q_lens)]
        new = torch.cat([self.slots[b][lens[b] - q : lens[b]] for b, q in enumerate(q_lens)])
        return SimpleNamespace(
            forward_mode=mode,
            batch_size=len(q_lens),
            req_pool_indices=self.rows.clone(),
            seq_lens=torch.tensor(seq, dtype=torch.int64),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
            seq_lens_sum=sum(seq),
            extend_seq_lens=torch.tensor(q_lens, dtype=torch.int32),
            extend_prefix_lens=torch.tensor([s - q for s, q in zip(seq, q_lens)], dtype=torch.int32),
            extend_seq_lens_cpu=list(q_lens),
            extend_prefix_lens_cpu=[s - q for s, q in zip(seq, q_lens)],
            out_cache_loc=new.to(torch.int64),
            out_cache_loc_is_physical=False,
            spec_info=spec_info,
            encoder_lens=None,
            kv_loc_plan=None,
        )


def dense_reference(
    runner,
    reqs: Requests,
    layer,
    q,
    q_lens,
    masks=None,
    cap: float = 0.0,
    scales=(1.0, 1.0),
    window_left: int = -1,
    sinks=None,
):
    """Plain-torch float64 attention over each request's whole KV (read through req_to_token).

    q: ``[T, Hq*D]``; masks: per request ``[q_len, kv_len]`` bool or None (causal, bottom-right);
    scales: ``(k_scale, v_scale)`` an fp8 pool's values are multiplied by; ``window_left`` (>= 0: keys
    at most that far behind the query); ``sinks [Hq]``: one logit per head in each row's denominator.
    Returns ``[T, Hq*D]``.
    """
    pool = runner.token_to_kv_pool
    kb, vb = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    outs, t = [], 0
    for b, ql in enumerate(q_lens):
        n = reqs.kv_lens[b]
        slots = runner.req_to_token_pool.req_to_token[reqs.rows[b], :n].long()
        k = (kb[slots].double() * float(scales[0])).repeat_interleave(HQ // HKV, 1)
        v = (vb[slots].double() * float(scales[1])).repeat_interleave(HQ // HKV, 1)
        qb = q[t : t + ql].view(ql, HQ, D).double()
        s = torch.einsum("qhd,khd->hqk", qb, k) * layer.scaling
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        pos = torch.arange(n - ql, n)[:, None]
        key = torch.arange(n)[None, :]
        m = masks[b] if masks is not None else key <= pos
        if window_left >= 0:
            m = m & (key >= pos - window_left)
        s = s.masked_fill(~m[None], -math.inf)
        if sinks is not None:  # the sink joins the denominator only: a column dropped after the softmax
            s = torch.cat([s, sinks.double()[:, None, None].expand(HQ, ql, 1)], -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1)[..., :n], v).reshape(ql, HQ * D))
        t += ql
    return torch.cat(outs).to(q.dtype)
