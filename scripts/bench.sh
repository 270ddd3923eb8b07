#!/usr/bin/env bash
# The main job: builds hybrid_alloc's wheel (maturin) into this checkout's target/pysite, next to
# the cached vLLM environment of one supported release (scripts/test-env.sh; HYBRID_ALLOC_VLLM,
# default 0.32.0), and runs `hybrid-alloc bench` with the given options (none: the default
# benchmark). Writes bench-out/bench.{json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/test-env.sh "${HYBRID_ALLOC_VLLM:-0.32.0}" | tail -n 1)
SITE=$(bash scripts/install-local.sh "$VENV/bin/python" | tail -n 1)
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m hybrid_alloc.cli bench "$@"
