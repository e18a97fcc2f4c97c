"""Fixtures of the fault suite: the e2e suite's (``tests/e2e/conftest.py``): tiny models, named pool shards on the
session's local Ray cluster (nodes a, b, c), one in-process vLLM engine at a time."""

from __future__ import annotations

from tests.e2e.conftest import engines, pool, tiny_models  # noqa: F401 - fixtures
