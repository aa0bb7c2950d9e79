"""What the GPU tests accept instead of a result, stated explicitly (no quiet skips on a GPU machine).

* A configuration a provider refuses on purpose is listed (key -> regex of the refusal) next to the
  test; the test then asserts the refusal (:func:`expect_refusal`) and passes. Any refusal that is
  not listed FAILS (:func:`unexpected_refusal`): a configuration that was supported and is now
  refused is a regression, not a skip. A listed one that is no longer refused fails too.
* On a CUDA machine a provider whose library cannot load FAILS (:func:`provider_unavailable`),
  unless ``ATTNPLUG_GPU_OPTIONAL_PROVIDERS`` (comma-separated) names it; then it skips with the
  reason. Without CUDA the GPU tests skip before reaching this.
"""

from __future__ import annotations

import os

import pytest

from attnplug.core import UnsupportedFeature


def optional_providers() -> set[str]:
    return {p.strip() for p in os.environ.get("ATTNPLUG_GPU_OPTIONAL_PROVIDERS", "").split(",") if p.strip()}


def provider_unavailable(provider: str, err: Exception):
    if provider in optional_providers():
        pytest.skip(f"provider {provider!r} unavailable (ATTNPLUG_GPU_OPTIONAL_PROVIDERS allows it): {err}")
    pytest.fail(
        f"provider {provider!r} unavailable on this CUDA machine: {err} "
        f"(set ATTNPLUG_GPU_OPTIONAL_PROVIDERS={provider} to let its tests skip)",
        pytrace=False,
    )


def unexpected_refusal(key, err: Exception):
    pytest.fail(
        f"{key}: refused, and not in the list of expected refusals (a supported configuration "
        f"that is now refused is a regression): {err}",
        pytrace=False,
    )


def expect_refusal(expected: dict, key):
    """``with expect_refusal(EXPECTED, key): <construct / plan>``: the listed refusal must happen."""
    return pytest.raises(UnsupportedFeature, match=expected[key])
