"""Opt-in deliberate failure: ``ATTNPLUG_GPU_SELFTEST_FAIL=1`` makes this test fail, to show that
``scripts/gpu_run.sh --all`` exits non-zero when a GPU suite fails (and writes the failure into its
summary and junit files). Without the variable it is skipped, with that reason."""

import os

import pytest


@pytest.mark.skipif(
    os.environ.get("ATTNPLUG_GPU_SELFTEST_FAIL") != "1",
    reason="opt-in: ATTNPLUG_GPU_SELFTEST_FAIL=1 makes this test fail on purpose",
)
def test_deliberate_failure_when_asked():
    pytest.fail("deliberate failure (ATTNPLUG_GPU_SELFTEST_FAIL=1): gpu_run.sh must now exit non-zero")
