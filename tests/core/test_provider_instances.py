"""One provider instance per (layer config, provider): the core's objects of one config share it and its
resources; forks keep their plans apart (FlashInfer's wrappers), so two plans stay valid at once."""

from __future__ import annotations

import gc

import pytest
import torch

from attnplug.core import AttentionConfig, PagedAttention
from attnplug.core.cuda_graph import GraphState
from attnplug.core.draft import MultiStepDraftPlanner
from attnplug.core.providers import Provider, get_provider_cls, provider_instance

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cfg(page=4):
    return AttentionConfig(8, 2, 64, page, torch.bfloat16)


class Counting(get_provider_cls("reference")):
    """The reference provider, counting constructions and forks (a fork: its own object, as FlashInfer's)."""

    name = "counting"
    built = 0

    def __init__(self, config, device):
        super().__init__(config, device)
        type(self).built += 1
        self.resource = object()

    def fork(self):
        f = object.__new__(type(self))
        f.__dict__.update(self.__dict__, base=self)
        return f


def test_one_instance_per_config_and_device():
    a, b = provider_instance("triton", cfg(), DEV), provider_instance("triton", cfg(), DEV)
    assert a is b and isinstance(a, Provider)
    assert provider_instance(get_provider_cls("triton"), cfg(), DEV) is a
    assert provider_instance("triton", cfg(page=8), DEV) is not a  # another config, another instance
    assert provider_instance(a, cfg(), DEV) is a  # an instance passes through
    with pytest.raises(ValueError, match="attnplug: provider 'triton' was built for"):
        provider_instance(a, cfg(page=8), DEV)


def test_core_objects_of_one_config_share_one_instance():
    Counting.built = 0
    c = cfg()
    attn = PagedAttention(c, Counting, DEV)
    attn2 = PagedAttention(c, Counting, DEV)
    draft = MultiStepDraftPlanner(AttentionConfig(8, 2, 64, 1, torch.bfloat16), 2, 3, 4, Counting, DEV)
    draft2 = MultiStepDraftPlanner(AttentionConfig(8, 2, 64, 1, torch.bfloat16), 2, 3, 4, Counting, DEV)
    assert Counting.built == 2  # one for the config, one for the draft's page-1 token config
    assert attn.provider is not attn2.provider and attn.provider.resource is attn2.provider.resource
    steps = draft.providers + draft2.providers
    assert len({id(p) for p in steps}) == len(steps) and len({id(p.resource) for p in steps}) == 1
    del attn, attn2, draft, draft2, steps
    gc.collect()
    PagedAttention(c, Counting, DEV)  # nothing holds the instance any more: a new one
    assert Counting.built == 3


def test_graph_families_share_the_configs_instance():
    c = cfg()
    base = provider_instance("triton", c, DEV)
    gs = GraphState(c, "triton", max_batch=4, max_tokens=4, max_pages=16, device=DEV)
    gv = GraphState(c, base, max_batch=4, max_tokens=16, max_pages=16, device=DEV, mode="verify", num_draft_tokens=4)
    assert gs.provider is base and gv.provider is base  # triton's plans live in the Plan objects: no fork
