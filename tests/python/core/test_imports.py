"""The package's import structure: no import circle between its modules, and the bench
(``hybrid_alloc.bench``) stays out of what a user or vLLM imports: ``import hybrid_alloc``,
``import hybrid_alloc.vllm`` and the plugin's entry point load no bench module.

The graph counts every ``import`` / ``from ... import`` a module's source holds, wherever it
stands (at the top, inside a function, under ``if TYPE_CHECKING:``): an import made lazily, or
for the type checker only, still ties the two modules together for a reader and for mypy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "python" / "hybrid_alloc"


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` of the package (and the compiled
    ``_core``, by its stub)."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")) + [PACKAGE / "_core.pyi"]:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # `from P import m` imports the module P.m when there is one, else names of P.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package() -> None:
    graph = _graph()
    assert {"hybrid_alloc", "hybrid_alloc.vllm.manager", "hybrid_alloc.bench.main", "hybrid_alloc.cli"} <= set(graph)
    assert "hybrid_alloc.vllm.compat" in graph["hybrid_alloc.vllm.manager"]
    assert "hybrid_alloc.bench.main" in graph["hybrid_alloc.cli"]  # a lazy import counts


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    assert _cycles(_graph()) == []


def test_only_the_cli_and_the_bench_import_the_bench() -> None:
    graph = _graph()
    outside = {
        name: sorted(t for t in targets if t.startswith("hybrid_alloc.bench"))
        for name, targets in graph.items()
        if not name.startswith("hybrid_alloc.bench") and name != "hybrid_alloc.cli"
    }
    assert {k: v for k, v in outside.items() if v} == {}


def _loaded_after(code: str) -> list[str]:
    """The ``hybrid_alloc`` modules loaded by ``code`` in a fresh interpreter."""
    probe = code + "\nimport sys\nprint('\\n'.join(sorted(m for m in sys.modules if m.startswith('hybrid_alloc'))))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_importing_the_package_loads_no_bench_module() -> None:
    loaded = _loaded_after(
        "import hybrid_alloc, hybrid_alloc.vllm, hybrid_alloc.vllm.plugin\n"
        "hybrid_alloc.Allocator, hybrid_alloc.BlockStored, hybrid_alloc.UnknownRequestError\n"
    )
    assert "hybrid_alloc._core" in loaded and "hybrid_alloc.vllm.plugin" in loaded
    assert [m for m in loaded if m.startswith("hybrid_alloc.bench")] == []


@pytest.mark.vllm
def test_the_adapter_loads_no_bench_module() -> None:
    pytest.importorskip("vllm")
    loaded = _loaded_after("import hybrid_alloc.vllm\nhybrid_alloc.vllm.HybridKVCacheManager\n")
    assert "hybrid_alloc.vllm.manager" in loaded
    assert [m for m in loaded if m.startswith("hybrid_alloc.bench")] == []
