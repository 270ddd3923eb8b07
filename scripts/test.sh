#!/usr/bin/env bash
# Runs every test: Rust (fmt, clippy, cargo test), the wheel build, the stub check, and
# pytest with the parity tests against the real vLLM 0.32.0 (installed in a cached venv
# by scripts/test-env.sh; a run whose vLLM tests would be skipped fails instead).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --all-targets -- -D warnings
cargo clippy --features python --lib -- -D warnings
step "cargo test (core, no Python)"
cargo test --release

step "test environment (vLLM 0.32.0)"
VENV=$(bash scripts/test-env.sh | tail -n 1)
PY="$VENV/bin/python"
step "wheel build (maturin) and install"
rm -rf target/wheels
"$VENV/bin/maturin" build --release --interpreter "$PY" -o target/wheels
"$PY" -m pip install -q --force-reinstall --no-deps target/wheels/hybrid_alloc-*.whl
step "stubs (mypy.stubtest)"
(cd /tmp && "$PY" -m mypy.stubtest hybrid_alloc._core)
step "pytest"
export HYBRID_ALLOC_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
"$PY" -m pytest tests/python -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning "$@"
