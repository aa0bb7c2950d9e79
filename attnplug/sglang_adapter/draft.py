"""``AttnplugMultiStepDraftBackend``: SGLang's multi-step EAGLE draft contract over the core's
``MultiStepDraftPlanner``.

SGLang's EAGLE worker drives a *container* (no ``AttentionBackend`` itself):

* ``init_forward_metadata(fb)`` once per draft pass (``fb.batch_size = B`` requests, ``seq_lens`` =
  committed prefixes, ``topk`` branches each), then step ``i`` (``0..num_steps-2``) runs the draft
  model with ``attn_backends[i]`` as the forward context's backend over ``B*topk`` query rows;
* under CUDA graphs: ``init_cuda_graph_state``, ``init_forward_metadata_out_graph(fb, in_capture)``,
  ``init_forward_metadata_in_graph``.

Where the draft tokens' KV lives is SGLang's layout (``compat.draft_token_columns``, the columns of
``req_to_token`` that its ``generate_draft_decode_kv_indices`` reads); the core turns prefix + draft
slots into one token-granular plan per step. All attention math is the core's.
"""

from __future__ import annotations

import logging

import torch

from attnplug.core import (
    AttentionConfig,
    GraphFamily,
    MultiStepDraftPlanner,
    UnsupportedFeature,
    csr_from_req_to_token,
    step_batches_from_token_table,
    token_config,
    token_view,
)

from . import compat
from .backend import AttnplugAttnBackend

logger = logging.getLogger(__name__)


class AttnplugDraftExtendBackend(AttnplugAttnBackend):
    """The EAGLE draft-extend backend: an :class:`AttnplugAttnBackend` whose CUDA graphs capture
    DRAFT_EXTEND(_V2) batches (``W`` tokens a request, causal after the prefix: a core chain family,
    ``AttnplugAttnBackend._draft_extend_graph_metadata``). SGLang captures draft extend only for backend
    types it lists; :func:`compat.declare_draft_extend_graphs` adds this class to them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft_extend = True


class AttnplugDraftStepBackend(AttnplugAttnBackend):
    """``attn_backends[step]``: a full ``AttentionBackend`` (pools, layer checks, KV writes) whose
    attention is draft step ``step`` of its container's plans."""

    def __init__(self, model_runner, parent, step: int, backend_name: str, provider: str | None):
        super().__init__(model_runner, backend_name=backend_name, provider=provider)
        self._parent, self._step = parent, step

    def init_forward_metadata(self, forward_batch) -> None:
        """The metadata of every step is the container's: plan them all."""
        self._parent.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._parent.init_cuda_graph_state(max_bs, max_num_tokens)

    def _metadata_ready(self) -> bool:
        return self._parent.metadata_ready()

    def _run(self, key: AttentionConfig, q3, k_cache, v_cache, out, scales: dict | None = None) -> None:
        self._parent.run_step(self._step, key, q3, k_cache, v_cache, out, scales or {})


class AttnplugMultiStepDraftBackend:
    """EAGLE multi-step draft decode (``topk`` branches, ``speculative_num_steps - 1`` attention steps).

    Args:
        model_runner: the draft model's ``ModelRunner``.
        topk, speculative_num_steps: SGLang's EAGLE settings (``speculative_num_steps >= 2``).
        backend_name: ``attnplug_triton`` / ``attnplug_flashinfer`` / ``attnplug_fa3``.
        provider: core provider override (default from the name).

    Raises:
        UnsupportedFeature: SGLang outside the hooked version range, a draft window
            (``--speculative-draft-window-size``), or whatever the per-step backends refuse.
    """

    needs_cpu_seq_lens = True

    def __init__(
        self,
        model_runner,
        topk: int,
        speculative_num_steps: int,
        backend_name: str = "attnplug_triton",
        provider: str | None = None,
    ):
        refusal = compat.draft_hook_refusal()
        if refusal is not None:
            raise UnsupportedFeature(refusal)
        if speculative_num_steps < 2 or topk < 1:
            raise ValueError(
                f"attnplug: multi-step draft needs speculative_num_steps >= 2 and topk >= 1, "
                f"got {speculative_num_steps}, {topk}"
            )
        window = compat.draft_decode_window(model_runner)
        if window != (0, 0):
            raise UnsupportedFeature(
                f"attnplug: backend '{backend_name}' does not support a draft decode window "
                f"{window} (--speculative-draft-window-size)"
            )
        self.topk, self.speculative_num_steps = int(topk), int(speculative_num_steps)
        self.num_attn_steps = self.speculative_num_steps - 1
        self.attn_backends = [
            AttnplugDraftStepBackend(model_runner, self, i, backend_name, provider) for i in range(self.num_attn_steps)
        ]
        b0 = self.attn_backends[0]
        self.backend_name, self.provider_name, self.device = backend_name, b0.provider_name, b0.device
        self.provider = b0.provider  # the class every step's backend resolved
        self.page_size, self.num_pages = b0.page_size, b0.num_pages
        self.req_to_token_pool, self.token_to_kv_pool = b0.req_to_token_pool, b0.token_to_kv_pool
        self.kv_index_translator = b0.kv_index_translator
        self._planners: dict[AttentionConfig, tuple] = {}  # config -> (planner, max_batch, max_prefix_tokens)
        self._inputs = None  # host (kv_indptr, kv_indices, last, draft_slots) of the current pass
        self._forward_id = 0
        self._planned: dict[AttentionConfig, int] = {}
        self._graphs: list[GraphFamily] | None = None  # one family per attention step
        self._graph_fwd = None  # bs*topk rows of the current CUDA-graph pass

    # -- eager ----------------------------------------------------------------------------------------
    def _read_table(self, fb, B: int):
        table = compat.kv_read_table(
            self.kv_index_translator, fb, self.req_to_token_pool.req_to_token, fb.req_pool_indices[:B]
        )
        if table is None:
            raise self.attn_backends[0].unsupported("translated (unified / virtual->physical) KV reads")
        return table

    def _seq_cpu(self, fb, B: int) -> torch.Tensor:
        seq = fb.seq_lens_cpu if getattr(fb, "seq_lens_cpu", None) is not None else fb.seq_lens.cpu()
        return seq[:B].to(torch.int64)

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan every draft step of this pass at once (one host->device copy per layer config)."""
        fb = forward_batch
        B = int(fb.batch_size)
        seq = self._seq_cpu(fb, B)
        ids, rows = self._read_table(fb, B)
        cols = compat.draft_token_columns(
            seq, self.topk, self.speculative_num_steps, self.page_size, self.num_attn_steps
        )
        width = max(int(seq.max()) if B else 0, int(cols.max()) + 1 if cols.numel() else 0)
        table = ids[rows.long()][:, :width].cpu()  # only this batch's rows and columns come to the host
        local = torch.arange(B)
        indptr, indices, last = csr_from_req_to_token(table, local, seq, self.page_size)
        slots = table[local[:, None, None].expand_as(cols), cols].long()
        self._inputs = (indptr, indices, last, slots, int(seq.sum()))
        self._forward_id += 1
        self._graph_fwd = None
        for key in list(self._planners):
            self._plan(key)

    def metadata_ready(self) -> bool:
        """This draft pass's metadata was built (eagerly or into the graph state)."""
        return self._inputs is not None or self._graph_fwd is not None

    def _planner(self, key: AttentionConfig, B: int, ntok: int):
        ent = self._planners.get(key)
        if ent is None or B > ent[1] or ntok > ent[2]:  # (re)size on demand, outside graphs only
            mb = max(B, 2 * ent[1] if ent else min(64, self.req_to_token_pool.size))
            mt = max(ntok, 2 * ent[2] if ent else self.num_pages * self.page_size)
            self.attn_backends[0].attention(key)  # the layer config is refused here, naming the backend
            ent = self._planners[key] = (
                MultiStepDraftPlanner(
                    key,
                    self.topk,
                    self.num_attn_steps,
                    mb,
                    provider=self.provider,
                    device=self.device,
                    max_prefix_tokens=mt,
                ),
                mb,
                mt,
            )
            self._planned.pop(key, None)
        return ent[0]

    def _plan(self, key: AttentionConfig):
        indptr, indices, last, slots, ntok = self._inputs
        planner = self._planner(key, int(last.numel()), ntok)
        if self._planned.get(key) != self._forward_id:
            planner.plan(indptr, indices, last, slots, num_pages=self.num_pages)
            self._planned[key] = self._forward_id
        return planner

    def run_step(self, step: int, key: AttentionConfig, q3, k_cache, v_cache, out, scales: dict | None = None) -> None:
        """Draft step ``step``'s attention of a layer of config ``key`` (what ``attn_backends[step]`` runs):
        its graph family's plan under CUDA graphs, else this pass's eager plan. ``scales``: fp8 KV."""
        scales = scales or {}
        if self._graph_fwd is not None:
            rows = self._graph_fwd
            self._graphs[step].run(key, rows, q3, token_view(k_cache, key), token_view(v_cache, key), out, **scales)
            return
        if self._inputs is None:
            raise RuntimeError(f"attnplug: backend '{self.backend_name}': draft forward before init_forward_metadata")
        self._plan(key).run(step, q3, k_cache, v_cache, out, **scales)

    # -- CUDA graphs ----------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """One core ``GraphState`` (decode, token granularity) per attention step and layer config,
        sized for ``max_bs`` requests = ``max_bs * topk`` rows."""
        b0 = self.attn_backends[0]
        b0.check_graph_support()
        rows, ctx = (
            int(max_bs) * self.topk,
            int(self.req_to_token_pool.req_to_token.shape[1]) + self.speculative_num_steps,
        )
        configs = list(b0.model_layer_configs()) or [b0.probe_config]
        self._graphs = [
            GraphFamily(
                self.provider,
                state_config=token_config,
                refuse=b0.refuse_graphs,
                max_batch=rows,
                max_tokens=rows,
                max_pages=rows * ctx,
                device=self.device,
                mode="decode",
                pad_page=0,
                max_seq_len=ctx,
            ).add(configs)
            for _ in range(self.num_attn_steps)
        ]

    def _graph_step_batches(self, fb, B: int, host: bool):
        """Per attention step, the ``BatchMetadata`` (DECODE, token slots) of the ``B*topk`` real rows:
        sizes from ``seq_lens_cpu``, slots gathered on the device (nothing read back; ``host``: every
        tensor on the host, at capture). A provider that re-plans on the host keeps its CSR there."""
        seq = self._seq_cpu(fb, B)
        ids, rows = self._read_table(fb, B)
        cols = compat.draft_token_columns(
            seq, self.topk, self.speculative_num_steps, self.page_size, self.num_attn_steps
        )
        batches = step_batches_from_token_table(ids, rows, seq, cols, self.num_attn_steps)
        host_plan = not self.provider.graph_support.device_refresh
        for b in batches:
            if host:
                b.kv_indices = b.kv_indices.cpu()
            elif not host_plan:  # device CSR: GraphState.update never reads it back
                b.qo_indptr, b.kv_indptr, b.kv_last_page_len = (
                    t.to(self.device, non_blocking=True) for t in (b.qo_indptr, b.kv_indptr, b.kv_last_page_len)
                )
        return batches

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Capture: plan every step's padded batch (``bs*topk`` rows) into its ``GraphState``; replay:
        in-place ``GraphState.update`` of every step. Without graph state: the eager metadata."""
        if self._graphs is None:
            if in_capture:
                raise self.attn_backends[0].unsupported("CUDA-graph capture without init_cuda_graph_state")
            self.init_forward_metadata(forward_batch)
            return
        fb = forward_batch
        bs = int(fb.batch_size)
        B = bs - int(getattr(fb, "num_padding", 0) or 0)
        batches = self._graph_step_batches(fb, B, host=in_capture)
        rows = bs * self.topk
        for family, batch in zip(self._graphs, batches):
            family.set_batch(rows, batch, capture=in_capture)
        self._graph_fwd = rows

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record: planning is host-side, in ``init_forward_metadata_out_graph``."""
