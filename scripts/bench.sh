#!/usr/bin/env bash
# The main job: installs hybrid_alloc (pip builds the wheel with maturin) into the cached
# vLLM 0.32.0 environment (scripts/test-env.sh) and runs `hybrid-alloc bench` with the
# given options (none: the default benchmark). Writes bench-out/bench.{json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/test-env.sh | tail -n 1)
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps .
exec "$VENV/bin/hybrid-alloc" bench "$@"
