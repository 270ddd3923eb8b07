"""The gate that runs vLLM's own ``tests/v1/core/`` against ours (``scripts/vllm-tests.sh``,
``tests/python/support/vllm_core_gate.py``): its exclusion list is well formed (every entry a
pattern and a reason, every section a supported release: dropping a release drops its
entries), its patterns match parametrized ids literally, and the fetch script finds the
``tests`` modules a test file imports. No vLLM needed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path, PurePosixPath

import pytest

from hybrid_alloc.vllm.releases import SUPPORTED_RELEASES
from vllm_core_gate import EXCLUSIONS, _match, read_exclusions

ROOT = Path(__file__).resolve().parents[3]


def _fetch_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("vllm_tests", ROOT / "scripts" / "vllm-tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_exclusion_sections_name_supported_releases() -> None:
    sections = re.findall(r"^\[([^\]]*)\]$", EXCLUSIONS.read_text(), re.M)
    assert sections, "no section"
    for section in sections:
        for release in section.split():
            assert release == "*" or release in SUPPORTED_RELEASES, f"[{section}] names {release}"


@pytest.mark.parametrize("release", SUPPORTED_RELEASES)
def test_every_exclusion_has_a_pattern_and_a_reason(release: str) -> None:
    entries = read_exclusions(EXCLUSIONS, release)
    assert entries
    for pattern, reason in entries:
        assert "::" in pattern and not pattern.startswith("tests/"), pattern
        assert len(reason) > 20, (pattern, reason)


def test_an_entry_without_a_reason_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "exclusions.txt"
    bad.write_text("[*]\ntest_x.py::test_y\n")
    with pytest.raises(pytest.UsageError, match="PATTERN -- REASON"):
        read_exclusions(bad, SUPPORTED_RELEASES[0])


def test_patterns_match_parametrized_ids_literally() -> None:
    assert _match("test_p.py::test_prefill[sha256]", "test_p.py::test_prefill[sha256]")
    assert not _match("test_p.py::test_prefill[sha256_cbor]", "test_p.py::test_prefill[sha256]")
    assert _match("test_p.py::test_w[2-104-0-0-32-32-False-1]", "test_p.py::test_w[*-False-1]")
    assert not _match("test_p.py::test_w[2-104-0-0-32-32-True-1]", "test_p.py::test_w[*-False-1]")
    assert _match("test_s.py::test_a[x]", "test_s.py::*")


def test_fetch_finds_the_tests_modules_a_file_imports() -> None:
    script = _fetch_script()
    source = (
        "from tests.v1.kv_connector.unit.utils import MockKVConfig\n"
        "from .utils import create_requests\n"
        "import vllm.v1.core.kv_cache_utils\n"
        "def f():\n    from tests.v1.core.test_prefix_caching import make_request\n"
    )
    found = script.imported_files(source, PurePosixPath("tests/v1/core/test_x.py"))
    assert PurePosixPath("tests/v1/kv_connector/unit/utils.py") in found
    assert PurePosixPath("tests/v1/core/utils.py") in found
    assert PurePosixPath("tests/v1/core/test_prefix_caching.py") in found
    assert not any(p.parts[0] == "vllm" for p in found)
