"""The flashinfer provider's calls into FlashInfer (``flashinfer._contract_items``) against FlashInfer's
*sources*, read with ``ast`` (FlashInfer needs CUDA to run): the H200-tested release 0.6.14, the
releases the newest engines pin (0.7.2.post1 by vLLM 0.33.0, 0.7.2 by SGLang 0.5.23) and the newest,
0.7.4 (what ``pip install 'attnplug[flashinfer]'`` resolves today). Every call must bind;
a mutated copy shows the check fails when a keyword or method vanishes, and that the provider then
refuses at startup with a message naming attnplug, the provider, the version and the change."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from attnplug import _contract
from attnplug.core import AttentionConfig
from attnplug.core.providers import flashinfer as fip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from wheel_sources import wheel_sources  # noqa: E402

VERSIONS = ("0.6.14", "0.7.2", "0.7.2.post1", "0.7.4")  # docs/compatibility.md: CPU CI "contract" rows
OURS = _contract.SourceTree(ROOT)


@pytest.fixture(scope="module", params=VERSIONS)
def fi_src(request):
    src = wheel_sources("flashinfer-python", request.param)
    assert os.path.isfile(os.path.join(src, "flashinfer", "prefill.py")), src
    return request.param, src


def results(src: str):
    return _contract.check(fip._contract_items(), _contract.SourceTree(src), OURS)


def test_every_flashinfer_call_binds(fi_src):
    version, src = fi_src
    res = results(src)
    assert not _contract.problems(res), "\n".join(f"{r.item.label}: {r.problems}" for r in res)
    found = {r.item.name for r in res if r.found}
    assert len(found) == len(res), f"not found in flashinfer {version}: {[r.item.label for r in res if not r.found]}"
    assert fip.interface_refusal(version, root=src) is None


def test_the_contract_covers_the_numerics_the_provider_passes():
    """Every keyword of the provider's wrapper ``plan`` calls is one the contract checks."""
    prov = object.__new__(fip.FlashInferProvider)  # plan_kwargs reads only the config (no GPU here)
    prov.config = AttentionConfig(32, 8, 128, 16, torch.bfloat16)
    plans = [it for it in fip._contract_items() if it.name.endswith(".plan")]
    assert len(plans) == 2
    for it in plans:
        assert set(prov.plan_kwargs()) <= set(it.kwargs), it.label


@pytest.mark.parametrize("mutation, needle", [
    (("prefill.py", "custom_mask: Optional[torch.Tensor] = None,", "custom_mask_v2: Optional[torch.Tensor] = None,"),
     "custom_mask"),
    (("decode.py", "return_lse: Literal[False] = False,", ""), "return_lse"),
])  # fmt: skip
def test_a_changed_call_refuses_the_provider(tmp_path, mutation, needle):
    src = wheel_sources("flashinfer-python", "0.7.4")
    dst = tmp_path / "fi"
    shutil.copytree(os.path.join(src, "flashinfer"), dst / "flashinfer", ignore=shutil.ignore_patterns("data", "jit"))
    rel, old, new = mutation
    path = dst / "flashinfer" / rel
    text = path.read_text()
    assert old in text, f"mutation anchor gone from flashinfer 0.7.4's {rel}"
    path.write_text(text.replace(old, new))
    why = fip.interface_refusal("0.7.4", root=str(dst))
    assert why and all(s in why for s in ("flashinfer 0.7.4", needle, "0.6.14")), why
    err = fip.FlashInferProvider.unavailable(why)
    assert str(err).startswith("attnplug: provider 'flashinfer' is unavailable: flashinfer 0.7.4 changed")


def test_a_tested_release_is_not_checked():
    assert fip.interface_refusal("0.6.14+cu130", root="/nonexistent") is None
