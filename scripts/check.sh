#!/usr/bin/env bash
# The fast half of scripts/test.sh, for before a commit or a push: cargo fmt --check, clippy (as CI
# runs it), cargo test --release, ruff (lint with import sorting, and format --check) and mypy (the
# package, and the tests that use the stub). No wheel build, no debug cargo test, no pytest.
# Took 7.5 minutes here (2026-12-01, 2 cores shared with other builds; cargo test --release 5 of them).
#
# ruff and mypy come from scripts/test-env.sh's default test environment (vLLM's CPU build; it
# builds it the first time: about 6.5 GB, up to half an hour), or from HYBRID_ALLOC_CHECK_VENV, any
# venv with ruff and mypy (`python -m venv v && v/bin/pip install ruff mypy pytest hypothesis`). Exit status 0 only if every
# step passed; the summary at the end gives each step's status and time.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# shellcheck source=scripts/steps.sh
source scripts/steps.sh

VENV=${HYBRID_ALLOC_CHECK_VENV:-}
if [ -z "$VENV" ]; then
  VENV=$(bash scripts/test-env.sh | tail -n 1) || { echo "check: no test environment"; exit 1; }
fi
rust_fast_steps
python_lint_steps "$VENV"
summary
exit "$FAILED"
