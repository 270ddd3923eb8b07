#!/usr/bin/env bash
# Runs every test: Rust (fmt, clippy, cargo test), the wheel build, the stub check, and pytest
# with the parity tests against the real vLLM, once for each supported release (each in a cached
# venv built by scripts/test-env.sh; a run whose vLLM tests would be skipped fails instead).
# HYBRID_ALLOC_VLLM_RELEASES narrows the releases (default "0.32.0 0.33.0"); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
RELEASES=${HYBRID_ALLOC_VLLM_RELEASES:-0.32.0 0.33.0}
step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --all-targets -- -D warnings
cargo clippy --features python --lib -- -D warnings
step "cargo test (core, no Python)"
cargo test --release

first=1
for release in $RELEASES; do
  step "test environment (vLLM $release)"
  VENV=$(bash scripts/test-env.sh "$release" | tail -n 1)
  PY="$VENV/bin/python"
  if [ $first = 1 ]; then
    step "wheel build (maturin) and install into target/pysite"
    SITE=$(bash scripts/install-local.sh "$PY" | tail -n 1)
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    step "stubs (mypy.stubtest)"
    (cd /tmp && "$PY" -m mypy.stubtest hybrid_alloc._core)
    first=0
  fi
  step "pytest (vLLM $release)"
  HYBRID_ALLOC_REQUIRE_VLLM=$release HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    "$PY" -m pytest tests/python -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning "$@"
done
