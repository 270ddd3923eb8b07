"""Shared test setup. Tests marked ``vllm`` need vLLM 0.32.0; with
``HYBRID_ALLOC_REQUIRE_VLLM=1`` (set by ``.ci/run``) a missing vLLM is an error, not a skip."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = os.environ.get("HYBRID_ALLOC_REQUIRE_VLLM") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM 0.32.0 installed")
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    if REQUIRE_VLLM:
        raise pytest.UsageError("HYBRID_ALLOC_REQUIRE_VLLM=1 but vLLM is not installed")
    skip = pytest.mark.skip(reason="vLLM is not installed")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
