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
