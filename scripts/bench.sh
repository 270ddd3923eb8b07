#!/usr/bin/env bash
# The main job: builds hybrid_alloc's wheel (maturin) into this checkout's target/pysite, next to
# the cached vLLM environment of one supported release (scripts/test-env.sh; HYBRID_ALLOC_VLLM,
# default test-env.sh's: the release whose CPU build runs an engine, ENGINE_RELEASE in
# python/hybrid_alloc/vllm/releases.py), and runs `hybrid-alloc bench` with the given options
# (none: the default benchmark: the serve workload's table first, then throughput, shared-prefix,
# decode-N and memory). Writes bench-out/bench.{json,png}. `bash scripts/bench.sh hits [options]` runs
# `hybrid-alloc hits` instead (as does `--suite hits`).
#
# The wheel is not installed into the environment, so `hybrid-alloc` is not on PATH: this script
# also writes target/bin/hybrid-alloc, a launcher for this checkout's build in that environment
# (`target/bin/hybrid-alloc hits --size full`), and says so on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/test-env.sh ${HYBRID_ALLOC_VLLM:+"$HYBRID_ALLOC_VLLM"} | tail -n 1)
SITE=$(bash scripts/install-local.sh "$VENV/bin/python" | tail -n 1)
mkdir -p target/bin
cat >target/bin/hybrid-alloc <<LAUNCHER
#!/bin/sh
# Written by scripts/bench.sh: this checkout's hybrid_alloc ($SITE) in $VENV.
PYTHONPATH="$SITE\${PYTHONPATH:+:\$PYTHONPATH}" exec "$VENV/bin/python" -m hybrid_alloc.cli "\$@"
LAUNCHER
chmod +x target/bin/hybrid-alloc
echo "bench: hybrid-alloc for this build: $PWD/target/bin/hybrid-alloc" >&2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = hits ]; then
  exec "$VENV/bin/python" -m hybrid_alloc.cli "$@"
fi
exec "$VENV/bin/python" -m hybrid_alloc.cli bench "$@"
