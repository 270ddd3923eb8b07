#!/usr/bin/env bash
# Builds the abi3 wheel (maturin, release) and installs it, without dependencies, into this
# checkout's target/pysite, which the tests and the bench put first on PYTHONPATH. The cached vLLM
# environments stay untouched, so several checkouts can share them. Usage:
# scripts/install-local.sh PYTHON (an interpreter with maturin, e.g. a test venv's). Prints the site dir.
# This build turns on the cargo feature bench-probe (the bench's `floor` probe, DecodeFloor, which the
# tests and `hybrid-alloc bench --managers ...,floor` use); the release wheel (pyproject.toml) leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$1
BIN=$(dirname "$PY")
rm -rf target/wheels target/pysite
"$BIN/maturin" build --release --features bench-probe --interpreter "$PY" -o target/wheels >&2
"$PY" -m pip install -q --no-deps --target target/pysite target/wheels/hybrid_alloc-*.whl >&2
echo "$PWD/target/pysite"
