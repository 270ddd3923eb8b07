"""What a user installs: one version (Cargo.toml's, read by maturin) everywhere, the
license file the metadata declares, the ``vllm`` extra, and the plugin's entry point."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import hybrid_alloc
from hybrid_alloc.vllm.releases import vllm_requirement

ROOT = Path(__file__).resolve().parents[3]


def _meta() -> importlib.metadata.PackageMetadata:
    return importlib.metadata.metadata("hybrid-alloc")


def test_one_version_everywhere() -> None:
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    assert hybrid_alloc.__version__ == cargo
    assert importlib.metadata.version("hybrid-alloc") == cargo
    assert "version" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dynamic"]


def test_license_matches_the_declared_one() -> None:
    meta = _meta()
    assert meta["License-Expression"] == "Apache-2.0"
    assert tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.split()) > 1500


def test_vllm_extra_pulls_a_supported_release() -> None:
    reqs = _meta().get_all("Requires-Dist") or []
    vllm = [r for r in reqs if re.match(r"vllm\b", r) and "extra == 'vllm'" in r]
    assert len(vllm) == 1 and vllm_requirement() in vllm[0].replace(" ", "")


def test_metadata_has_readme_and_classifiers() -> None:
    meta = _meta()
    assert meta["Description-Content-Type"].startswith("text/markdown")
    assert (meta.get_payload() or "").startswith("# hybrid_alloc")  # type: ignore[attr-defined]
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Rust" in classifiers and "Typing :: Typed" in classifiers


def test_plugin_entry_point_is_registered() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("hybrid_alloc") == "hybrid_alloc.vllm.plugin:register"
