"""scripts/peer_suite.py's verdicts: from pytest outcomes of the engines' own tests to one verdict per
(case, backend); an attnplug failure is excused only by its refusal message or by every native
backend of the run failing the same case the same way."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("peer_suite_cli", os.path.join(ROOT, "scripts", "peer_suite.py"))
ps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ps)

REFUSED = "UnsupportedFeature: attnplug: backend ATTNPLUG_TRITON does not support non-causal attention (x)\ntb"
UNAVAILABLE = (
    "ProviderUnavailable: attnplug: backend ATTNPLUG_FA3 cannot start on cpu: provider 'fa3' is "
    "unavailable: it needs a Hopper CUDA GPU. To install: ..."
)


def row(case, backend, outcome, message=""):
    return {"case": case, "backend": backend, "outcome": outcome, "message": message}


def verdict_of(rows, case, backend, engine="vllm"):
    out = ps.verdicts(engine, rows)
    (r,) = [r for r in out if r["case"] == case and r["backend"] == backend]
    return r["verdict"], r["detail"], r["unexpected"]


def test_split_id_takes_the_backend_out_of_the_test_id():
    assert ps.split_id("test_c[backend=ATTNPLUG_TRITON-auto-1-m-small_decode]") == (
        "test_c[auto-1-m-small_decode]",
        "ATTNPLUG_TRITON",
    )
    assert ps.split_id("test_d[case=mha_x-backend=attnplug_fa3]") == ("test_d[case=mha_x]", "attnplug_fa3")


def test_refusals_name_the_feature():
    rows = [
        row("c", "ATTNPLUG_TRITON", "failed", REFUSED),
        row("c", "ATTNPLUG_FA3", "failed", UNAVAILABLE),
        row("c", "FLEX_ATTENTION", "passed"),
    ]
    assert verdict_of(rows, "c", "ATTNPLUG_TRITON") == ("refused", "non-causal attention (x)", False)
    v, detail, bad = verdict_of(rows, "c", "ATTNPLUG_FA3")
    assert (v, bad) == ("refused", False) and detail.startswith("cannot start on cpu: provider 'fa3'")
    assert "To install" not in detail


def test_a_failure_a_native_passes_is_unexpected():
    rows = [
        row("c", "ATTNPLUG_TRITON", "failed", "AssertionError: output differs"),
        row("c", "FLEX_ATTENTION", "passed"),
        row("c", "TRITON_ATTN", "failed", "AssertionError: differs"),
    ]
    assert verdict_of(rows, "c", "ATTNPLUG_TRITON")[::2] == ("failed", True)


def test_fails_natively_too_needs_every_native_to_fail_the_same_way():
    same = [
        row("c", "ATTNPLUG_TRITON", "failed", "AssertionError: output differs"),
        row("c", "TRITON_ATTN", "failed", "AssertionError: differs too"),
        row("c", "CPU_ATTN", "skipped", "n/a"),
    ]
    v, detail, bad = verdict_of(same, "c", "ATTNPLUG_TRITON")
    assert (v, bad) == ("fails natively too", False) and detail.startswith("TRITON_ATTN fail too")
    other = [same[0], row("c", "TRITON_ATTN", "failed", "AttributeError: no next_power_of_2")]
    assert verdict_of(other, "c", "ATTNPLUG_TRITON")[::2] == ("failed", True)
    alone = [same[0], row("c", "CPU_ATTN", "skipped", "n/a")]  # no native ran: nothing to compare with
    assert verdict_of(alone, "c", "ATTNPLUG_TRITON")[::2] == ("failed", True)


def test_skips_and_fixes():
    rows = [
        row("c", "ATTNPLUG_TRITON", "skipped", "Skipped: no"),
        row("c", "FLEX_ATTENTION", "skipped", "x"),
        row("c", "attnplug_triton", "passed"),
    ]
    assert verdict_of(rows, "c", "ATTNPLUG_TRITON")[::2] == ("skipped", True)
    assert verdict_of(rows, "c", "FLEX_ATTENTION")[::2] == ("skipped", False)
    v, detail, _ = verdict_of(rows, "c", "attnplug_triton", engine="sglang")
    assert v == "fixed" and "model_runner.dtype" in detail
    assert verdict_of(rows, "c", "attnplug_triton", engine="vllm")[0] == "passed"


def test_hf_home_holds_the_configs_the_sliding_window_tests_name(tmp_path):
    """The offline hub cache: one snapshot config.json per model of HF_CONFIGS, ``refs/main`` naming it."""
    import json

    home = ps._hf_home(str(tmp_path))
    window = {}
    for model in ("meta-llama/Meta-Llama-3-8B", "microsoft/Phi-tiny-MoE-instruct", "google/embeddinggemma-300m"):
        repo = os.path.join(home, "hub", "models--" + model.replace("/", "--"))
        with open(os.path.join(repo, "refs", "main")) as fh:
            snap = fh.read()
        with open(os.path.join(repo, "snapshots", snap, "config.json")) as fh:
            cfg = json.load(fh)
        assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
        window[model] = cfg.get("sliding_window")
    assert window == {
        "meta-llama/Meta-Llama-3-8B": None,
        "microsoft/Phi-tiny-MoE-instruct": 2047,
        "google/embeddinggemma-300m": 512,
    }


def test_the_ci_selection_reaches_the_sliding_window():
    """scripts/test.sh's ``sel[peer-vllm]`` (pytest -k: case-insensitive substrings of the test id) picks
    the small causal case and a sliding-window case whose sequences are longer than Phi-tiny-MoE's
    window (a window shorter than every sequence of a case is never applied), and no large one."""
    import re

    from _pytest.mark.expression import Expression

    with open(os.path.join(ROOT, "scripts", "test.sh")) as fh:
        (sel,) = re.findall(r'\[peer-vllm\]="([^"]*)"', fh.read().split("declare -A sel=", 1)[1])
    expr = Expression.compile(sel)

    def picked(test, case):
        name = f"{test}[backend=ATTNPLUG_TRITON-{case}]".lower()
        return expr.evaluate(lambda s, **kw: s.lower() in name)

    sw, phi = "test_sliding_window_backend_correctness", "microsoft/Phi-tiny-MoE-instruct"
    # the longest sequence of each batch spec test_sliding_window_backend_correctness runs (vLLM 0.32.0)
    longest = {"small_decode": 40, "small_prefill": 40, "mixed_medium": 2048, "large_decode": 2048}
    longest |= {"large_prefill": 4096, "mixed_large": 4096}
    chosen = [(tp, spec) for tp in (1, 2, 4) for spec in longest if picked(sw, f"{tp}-{phi}-{spec}")]
    assert any(longest[spec] > ps.HF_CONFIGS[phi]["sliding_window"] for _, spec in chosen), chosen
    assert not any(spec.startswith("large") for _, spec in chosen), chosen
    assert picked("test_causal_backend_correctness", "auto-1-meta-llama/Meta-Llama-3-8B-small_decode")
    assert not picked("test_causal_backend_correctness", "auto-1-meta-llama/Meta-Llama-3-8B-large_decode")
