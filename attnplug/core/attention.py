"""``PagedAttention``: the one entry point engines and tests use (FlashInfer-style plan/run).

attn = PagedAttention(config, provider="triton", device="cuda")
attn.plan(batch, num_pages=k_cache.shape[0])   # once per forward: validation + kernel args
for layer in layers:
    attn.run(q, k_cache[layer], v_cache[layer], out=o)   # per layer: launches kernels only
"""

from __future__ import annotations

import torch

from .cascade import cascade_mode, plan_cascade, run_cascade
from .config import AttentionConfig
from .metadata import BatchMetadata
from .plan import Plan, check_run_bounds, check_run_inputs, make_plan
from .providers import Provider, provider_instance


class PagedAttention:
    """Paged attention over one KV-cache layout, through one provider.

    Args:
        config: static configuration shared by the layers that use this object.
        provider: a registered provider name (``"triton"``, ``"flashinfer"``, ``"fa3"``, ``"reference"``),
            class or instance (:func:`~attnplug.core.providers.provider_instance`: one per config, forked).
        device: device of q and the KV cache.

        cascade: shared-prefix (cascade) attention, ``"off"`` / ``"auto"`` / ``"always"``
            (default: ``$ATTNPLUG_CASCADE``, else ``"auto"``; see :mod:`attnplug.core.cascade`).

    Raises:
        ProviderUnavailable: the provider cannot run here (message has an install hint).
        UnsupportedFeature: the provider cannot compute this configuration.
    """

    def __init__(
        self,
        config: AttentionConfig,
        provider: str | type[Provider] | Provider = "triton",
        device: torch.device | str = "cuda",
        cascade: str | None = None,
    ):
        self.config = config
        self.device = torch.device(device)
        self.provider = provider_instance(provider, config, self.device).fork()  # own plans, shared resources
        # fp8 KV: the scale used where run() gets none (a tensor, so that kernels read it on the device)
        self._unit_scale = torch.ones(1, dtype=torch.float32, device=self.device) if config.kv_quantized else None
        self.cascade = cascade_mode(cascade)
        self._prefix_provider = None  # the cascade's prefix part: a fork (its plans apart, resources shared)
        self._plan: Plan | None = None

    @property
    def provider_name(self) -> str:
        return self.provider.name

    @property
    def current_plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("attnplug: run() called before plan()")
        return self._plan

    def plan(self, batch: BatchMetadata, num_pages: int | None = None, **knobs) -> Plan:
        """Validate ``batch`` and build every kernel argument of this forward.

        ``knobs``: fields of the provider's :attr:`~attnplug.core.providers.base.Provider.Options` (e.g.
        ``num_kv_splits`` for triton); a knob this provider does not read raises ``ValueError``.
        """
        options = self.provider.parse_options(knobs)
        plan = make_plan(self.config, batch, num_pages=num_pages, device=self.device)
        plan.options = options
        plan.cascade = plan_cascade(plan, self.cascade)
        if plan.cascade is None:
            self.provider.plan(plan)
        else:  # shared prefixes: the provider plans the suffix and the prefix parts instead
            if self._prefix_provider is None:
                self._prefix_provider = self.provider.fork()
            self.provider.plan(plan.cascade.suffix)
            self._prefix_provider.plan(plan.cascade.prefix)
        self._plan = plan
        return plan

    def check_inputs(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Validate run() arguments against the config and current plan (setup time, not per layer)."""
        check_run_inputs(self.config, self.current_plan, q, k_cache, v_cache)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        host_scales: tuple[float, float] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``q [T, Hq, D]`` over the paged cache; returns ``out [T, Hq, Dv]`` (``Dv``:
        ``config.head_dim_v``, = ``D`` but for MLA, :mod:`attnplug.core.mla`).

        ``lse [T, Hq]`` float32, when given, receives the natural-log LSE of each row. Pass ``out``
        to avoid an allocation (required under CUDA-graph capture).

        fp8 KV cache (``config.kv_dtype``): ``k_scale`` / ``v_scale`` are the layer's one-element
        float32 scales on the device (keys = ``k_cache * k_scale``; default 1), read by the kernels
        on the device (a graph captures them, in-place updates apply); ``q_scale`` is the scale
        providers that quantize q to fp8 (fa3) use (default 1). ``host_scales``: ``(k, v)`` as host
        floats when the engine fixes them (``Provider.run``). Ignored for unquantized caches.

        ``sinks [Hq]`` (float32 or the model dtype, on the device; required iff ``config.sinks``): each
        head's sink logit, read on the device; ``lse`` then includes it.
        """
        scales = self.config.scale_kwargs(self._unit_scale, k_scale, v_scale, q_scale, host_scales)
        scales.update(self.config.sink_kwargs(sinks))
        plan = self.current_plan
        check_run_bounds(plan, q, k_cache, v_cache, out)
        if out is None:
            out = q.new_empty(q.shape[0], self.config.num_qo_heads, self.config.head_dim_v)
        if plan.cascade is None:
            self.provider.run(plan, q, k_cache, v_cache, out, lse, **scales)
        else:
            run_cascade(plan.cascade, self.provider, self._prefix_provider, q, k_cache, v_cache, out, lse, **scales)
        return out
