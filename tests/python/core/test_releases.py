"""The supported vLLM releases are written once, in ``hybrid_alloc.vllm.releases``: the plugin,
the bench's install hint, the tests and the shell scripts read that list, and this file fails
when a copy that must stay literal disagrees with it (the README, ``docs/install.md``,
``docs/compatibility.md``, ``docs/development.md``, ``pyproject.toml``'s ``vllm`` extra,
``scripts/test-env.sh``'s recipes), or when a new copy of the whole list appears in the code,
the tests or the scripts. Adding a release: ``docs/development.md``, "Adding a vLLM release".
No vLLM needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from hybrid_alloc.vllm import releases
from hybrid_alloc.vllm.releases import ENGINE_RELEASE, SUPPORTED_RELEASES, vllm_requirement

ROOT = Path(__file__).resolve().parents[3]
RELEASES_PY = ROOT / "python" / "hybrid_alloc" / "vllm" / "releases.py"
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}

# A release or minor release as prose writes it: 0.34.0, 0.34.x or 0.34.
_RELEASE = r"\d+\.\d+(?:\.\d+|\.x)?"
# Releases in a row, as an enumeration writes them: "A, B and C", "A, B or C", "A/B", "A and vLLM B".
_ENUMERATION = re.compile(rf"{_RELEASE}(?:(?:\s*,\s*(?:and\s+|or\s+)?|\s+and\s+|\s+or\s+|/)(?:vLLM\s+)?{_RELEASE})+")


def _read(rel: str) -> str:
    return (ROOT / rel).read_text()


def _releases_in(text: str) -> list[str]:
    """The releases ``text`` names, in order (``0.34.x`` as written)."""
    return re.findall(_RELEASE, text)


def _minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


def _one(pattern: str, text: str, where: str) -> str:
    found = re.findall(pattern, text, flags=re.MULTILINE)
    assert len(found) == 1, f"{where}: expected one match of {pattern!r}, found {found}"
    return found[0]


def _assert_names_the_list(pattern: str, rel: str) -> None:
    named = _releases_in(_one(pattern, _read(rel), rel))
    assert named == list(SUPPORTED_RELEASES), f"{rel} names {named}, releases.py {list(SUPPORTED_RELEASES)}"


def test_the_list_is_well_formed() -> None:
    assert len(SUPPORTED_RELEASES) >= 1
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", r) for r in SUPPORTED_RELEASES), SUPPORTED_RELEASES
    keys = [tuple(int(p) for p in r.split(".")) for r in SUPPORTED_RELEASES]
    assert keys == sorted(set(keys)), "oldest first, each once"
    assert ENGINE_RELEASE in SUPPORTED_RELEASES


def test_the_scripts_read_the_source_file_as_the_package_does() -> None:
    """The scripts run the checkout's file; the tests import the built package: the same list."""
    run = [sys.executable, str(RELEASES_PY)]
    assert subprocess.run(run, capture_output=True, text=True, check=True).stdout.split() == list(SUPPORTED_RELEASES)
    engine = subprocess.run([*run, "--engine"], capture_output=True, text=True, check=True).stdout.strip()
    assert engine == ENGINE_RELEASE
    assert subprocess.run([*run, "--bogus"], capture_output=True, text=True).returncode == 2
    assert Path(releases.__file__).read_text() == RELEASES_PY.read_text(), "rebuild: the package's list is stale"


def test_test_sh_lanes_default_to_the_list() -> None:
    line = _one(r"^RELEASES=.*$", _read("scripts/test.sh"), "scripts/test.sh")
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_ALLOC_VLLM_RELEASES"}
    script = f'{line}\nfor r in $RELEASES; do echo "$r"; done'
    lanes = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert lanes.stdout.split() == list(SUPPORTED_RELEASES)
    env["HYBRID_ALLOC_VLLM_RELEASES"] = SUPPORTED_RELEASES[-1]
    narrowed = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert narrowed.stdout.split() == [SUPPORTED_RELEASES[-1]]


def test_test_env_refuses_another_release_before_building_anything(tmp_path: Path) -> None:
    # PIP_NO_INDEX: should the refusal ever break, pip fails at once instead of downloading GBs.
    env = dict(os.environ, HYBRID_ALLOC_VENV_DIR=str(tmp_path), PIP_NO_INDEX="1")
    out = subprocess.run(
        ["bash", "scripts/test-env.sh", "0.31.9"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    supported = " ".join(SUPPORTED_RELEASES)
    assert f"unsupported vLLM release '0.31.9' (supported: {supported};" in out.stderr
    assert "releases.py" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_test_env_has_one_recipe_per_release() -> None:
    text = _read("scripts/test-env.sh")
    recipes = text[text.index('case "$VLLM_VERSION" in') :]
    cases = re.findall(r"^  (\S+)\)$", recipes[: recipes.index("\nesac")], flags=re.MULTILINE)
    assert cases == [*SUPPORTED_RELEASES, "*"], f"scripts/test-env.sh's recipes: {cases}"
    described = re.findall(r"^# (\d+\.\d+\.\d+): ", text, flags=re.MULTILINE)
    assert described == list(SUPPORTED_RELEASES), f"scripts/test-env.sh's header describes {described}"


def test_scripts_name_no_release_outside_the_recipes() -> None:
    """Defaults and lanes come from releases.py; only test-env.sh's case labels spell one."""
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
            if path.name == "test-env.sh" and re.fullmatch(r"  \d+\.\d+\.\d+\)", code):
                continue
            named = [r for r in SUPPORTED_RELEASES if r in code]
            assert not named, f"{path.relative_to(ROOT)}:{n} names {named}: read releases.py instead"


def test_pyproject_vllm_extra_spans_the_list() -> None:
    extras = tomllib.loads(_read("pyproject.toml"))["project"]["optional-dependencies"]
    assert extras["vllm"] == [vllm_requirement()]


def test_readme_names_the_list() -> None:
    _assert_names_the_list(r"plugged into \*\*vLLM ([^*]+)\*\*", "README.md")
    _assert_names_the_list(r"# every test, on vLLM (.+)$", "README.md")
    text = _read("README.md")
    assert _releases_in(_one(r"# the main job: .* on vLLM (\S+)$", text, "README.md")) == [ENGINE_RELEASE]
    assert set(re.findall(r"vllm>=[\d.]+,<[\d.]+", text)) == {vllm_requirement()}


def test_install_doc_names_the_list() -> None:
    # Whitespace folded: the sentence may wrap across lines.
    text = " ".join(_read("docs/install.md").split())
    works = _releases_in(_one(r"It works with vLLM (.+?)\. ", text, "docs/install.md"))
    assert works == [f"{_minor(r)}.x" for r in SUPPORTED_RELEASES], works
    assert set(re.findall(r"vllm>=[\d.]+,<[\d.]+", text)) == {vllm_requirement()}


def test_compatibility_doc_names_the_list() -> None:
    rel = "docs/compatibility.md"
    text = _read(rel)
    header = _one(r"^\| configuration \|.*$", text, rel)
    assert _releases_in(header) == list(SUPPORTED_RELEASES), header
    _assert_names_the_list(r"^- `HYBRID_ALLOC=1` on vLLM (.+?): ", rel)
    _assert_names_the_list(r"is not a tested release \(tested: (.+?)\)", rel)
    _assert_names_the_list(r"^One wheel serves (.+?);", rel)
    assert f"\n## vLLM {SUPPORTED_RELEASES[-1]}\n" in text, f"{rel}: no section for the newest release"


def test_development_doc_lists_an_environment_per_release_and_the_checklist() -> None:
    text = _read("docs/development.md")
    venvs = re.findall(r"^- `venv-vllm-(\S+)-py3XX`", text, flags=re.MULTILINE)
    assert venvs == list(SUPPORTED_RELEASES), venvs
    assert "\n## Adding a vLLM release\n" in text
    assert '"Adding a vLLM release"' in RELEASES_PY.read_text()


def test_docs_count_the_releases_right() -> None:
    """Where a page counts the supported releases ("all three releases"), the count is right."""
    word = NUMBER_WORDS[len(SUPPORTED_RELEASES)]
    for rel in ("README.md", "docs/install.md", "docs/compatibility.md", "docs/development.md"):
        for said in re.findall(r"\ball (\w+) (?:supported )?releases\b", _read(rel)):
            assert said == word, f"{rel} says 'all {said} releases'; there are {len(SUPPORTED_RELEASES)}"


def test_no_other_copy_of_the_whole_list_in_the_code() -> None:
    """A docstring or comment that lists every supported release goes stale with the next one:
    say "the supported releases" (``hybrid_alloc.vllm.releases``) instead. A list of some of them,
    for what differs between them, is fine."""
    whole = {_minor(r) for r in SUPPORTED_RELEASES}
    copies = []
    for top, pattern in (("python", "*.py"), ("tests/python", "*.py"), ("scripts", "*"), ("rust", "*.rs")):
        for path in sorted((ROOT / top).rglob(pattern)):
            if path == RELEASES_PY or not path.is_file():
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for m in _ENUMERATION.finditer(line):
                    named = {_minor(r) for r in _releases_in(m.group())}
                    if len(whole) > 1 and named == whole:
                        copies.append(f"{path.relative_to(ROOT)}:{n}: {m.group()}")
    assert not copies, "\n".join(copies)
