"""Tests that need network namespaces (the emulated cluster's netns mode) skip without them, naming why, or
fail when ``PIPECAST_REQUIRE_NETNS=1`` (CI sets it: there they must run, not skip)."""

import os

import pytest

from benchmarks.cluster import detect_mode

REQUIRE_ENV = "PIPECAST_REQUIRE_NETNS"


def require_netns() -> None:
    """Return if netns mode works here; else skip (or fail, where it is required)."""
    choice = detect_mode()
    if choice.mode == "netns":
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"network namespaces are required ({REQUIRE_ENV}=1) but unavailable: {choice.reason}")
    pytest.skip(f"netns mode unavailable: {choice.reason}")
