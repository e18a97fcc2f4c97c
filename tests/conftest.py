"""Shared pytest configuration: the markers and the session-wide Ray cluster fixture."""

from __future__ import annotations

import pytest

from tests.ray_cluster_fixture import ray_cluster  # noqa: F401 - the one session-wide Ray cluster fixture


def pytest_configure(config: pytest.Config) -> None:
    for marker, doc in [
        ("integration", "real local Ray cluster / NIXL / files"),
        ("e2e", "real vLLM replicas (CPU build) and the OpenAI SDK"),
        ("slow", "takes more than ~30 s"),
        ("reuse_correctness", "token-identical KV reuse matrix (one test per cell)"),
        ("faults", "fault suite: real Ray, real vLLM (CPU build), real pool shards, a real fault injected"),
    ]:
        config.addinivalue_line("markers", f"{marker}: {doc}")
