"""Installed but not selected (issue 17 §2), SGLang: with attnplug installed and its plugin loaded but
another backend selected, the tokens are identical to an environment without attnplug (SGLang's
plugin whitelist excludes it), and broken triton / flashinfer / FA3 installs (the stand-ins of
``tests/vllm/broken_kernel_libs``, which raise on import) change nothing either: attnplug's
registration never imports them, so whatever SGLang itself does with them is the same with and
without attnplug.

Six ``sglang.Engine`` runs of ``torch_native`` (one process each: the plugin whitelist and the import
path are fixed at process start): {attnplug plugin loaded, not loaded} x {clean, broken triton,
broken flashinfer + FA3}. SGLang imports triton itself, so with the broken triton both runs fail
alike at import (seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sglang_helpers import HERE, REPO, subprocess_env

pytestmark = pytest.mark.sglang

BROKEN = REPO / "tests" / "vllm" / "broken_kernel_libs"
NO_PLUGIN = "attnplug-test-none"  # SGLANG_PLUGINS whitelist naming no installed plugin: none is loaded
MAX_NEW = 8


def _engine(tmp, name, tiny_model, prompts, **env):
    d = tmp / name
    (d / "markers").mkdir(parents=True)
    spec = {
        "model": str(tiny_model),
        "prompts": prompts,
        "max_new_tokens": MAX_NEW,
        "waves": [[0, 1, 3, 4], [2]],
        "runs": [
            {
                "name": name,
                "engine": {"attention_backend": "torch_native"},
                "env": {"ATTNPLUG_MARKER_DIR": str(d / "markers")},
            }
        ],
    }
    (d / "spec.json").write_text(json.dumps(spec))
    e = subprocess_env(**env)
    p = subprocess.run(
        [sys.executable, str(HERE / "engine_script.py"), str(d / "spec.json"), str(d / "out.json")],
        env=e,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = (
        json.loads((d / "out.json").read_text())[name]
        if (d / "out.json").exists()
        else {"ok": False, "error": p.stderr[-3000:]}
    )
    return out, p.stdout + p.stderr, list((d / "markers").glob("*.json"))


def _standins(tmp, names):
    """A directory that shadows ``names`` with the broken stand-ins (symlinks), for PYTHONPATH."""
    d = tmp / ("broken-" + "-".join(names))
    d.mkdir()
    for n in names:
        (d / n).symlink_to(BROKEN / n, target_is_directory=True)
    return d


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Broken triton alone (SGLang imports triton itself), then broken flashinfer + FA3 with a working triton."""
    from attnplug.tools.tiny_model import test_prompts

    tmp = tmp_path_factory.mktemp("unselected")
    prompts = test_prompts()
    base = subprocess_env()["PYTHONPATH"]
    out = {
        "plugin": _engine(tmp, "plugin", tiny_model, prompts),
        "no_plugin": _engine(tmp, "no_plugin", tiny_model, prompts, SGLANG_PLUGINS=NO_PLUGIN),
    }
    for tag, names in (("triton", ["triton"]), ("fi_fa3", ["flashinfer", "flash_attn_interface"])):
        path = os.pathsep.join([str(_standins(tmp, names)), base])
        out[f"plugin_{tag}"] = _engine(tmp, f"plugin_{tag}", tiny_model, prompts, PYTHONPATH=path)
        out[f"no_plugin_{tag}"] = _engine(
            tmp, f"no_plugin_{tag}", tiny_model, prompts, SGLANG_PLUGINS=NO_PLUGIN, PYTHONPATH=path
        )
    return out


def test_unselected_tokens_equal_an_environment_without_attnplug(runs):
    (ours, _log, markers), (bare, bare_log, _) = runs["plugin"], runs["no_plugin"]
    assert ours["ok"], ours.get("error")
    assert bare["ok"], bare.get("error")
    assert ours["output_ids"] == bare["output_ids"]
    assert markers == []  # attnplug's backend never ran
    assert "Skipping plugin attnplug" in bare_log or "attnplug" not in bare_log  # really an environment without it


@pytest.mark.parametrize("tag", ["triton", "fi_fa3"])
def test_broken_kernel_libraries_change_nothing_when_unselected(runs, tag):
    """Same outcome with and without attnplug when triton (or flashinfer and FA3) are broken: identical
    tokens where SGLang runs with them, the same failure where SGLang itself needs one of them."""
    (ours, log, markers), (bare, _bare_log, _) = runs[f"plugin_{tag}"], runs[f"no_plugin_{tag}"]
    assert ours["ok"] == bare["ok"], (ours.get("error", "")[-2000:], bare.get("error", "")[-2000:])
    if ours["ok"]:
        assert ours["output_ids"] == bare["output_ids"] == runs["plugin"][0]["output_ids"]
    else:  # SGLang itself imports the library: the same error either way
        assert ours["error"].splitlines()[0] == bare["error"].splitlines()[0]
    if tag == "fi_fa3":
        assert ours["ok"], ours.get("error", "")[-3000:]  # SGLang on CPU needs neither: attnplug must not either
    assert markers == []
    assert str(REPO / "attnplug") not in log  # no frame of attnplug in any traceback
