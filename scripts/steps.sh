# Sourced by scripts/test.sh and scripts/check.sh (not run on its own): the step runner and the
# steps both scripts share, so the fast half (check.sh) is the same commands as the full run.
#
# run NAME CMD...    runs one step, prints its time, records its status for the summary
# record NAME RC S   records a step that ran some other way (S seconds)
# summary            prints every step's status and time, then ALL PASSED or SOME STEPS FAILED
# rust_fast_steps    cargo fmt --check, both clippy runs CI runs, cargo test --release
# python_lint_steps VENV
#                    ruff check and ruff format --check over PY_LINT_PATHS, mypy over the package
#                    (pyproject's [tool.mypy]), mypy over MYPY_TEST_FILES (tests that use the stub)
# Every step runs even if an earlier one failed; FAILED is 1 once any step failed.

T0=$SECONDS
SUMMARY=()
FAILED=0

# What ruff lints and format-checks ([tool.ruff] in pyproject.toml: import sorting included).
PY_LINT_PATHS=(python/hybrid_alloc tests/python benches examples)
# The test files that call the compiled module directly, type-checked against python/hybrid_alloc's
# stub (_core.pyi), as a user's code would be: a stub that types a parameter too narrowly fails here.
MYPY_TEST_FILES=(tests/python/core/test_api.py tests/python/core/test_stateful.py tests/python/bench/test_bench_noplot.py
  tests/python/core/test_typed_boundary.py tests/python/core/test_api_defects.py tests/python/core/test_hints_core.py)

run() {
  local name=$1 rc start
  shift
  start=$SECONDS
  printf '\n== %s (%s)\n' "$name" "$(date +%T)"
  "$@"
  rc=$?
  record "$name" "$rc" $((SECONDS - start))
  return "$rc"
}

record() {
  local name=$1 rc=$2 secs=$3 status=ok
  [ "$rc" = 0 ] || { status="FAILED (exit $rc)"; FAILED=1; }
  printf -- '-- %s: %s in %dm%02ds\n' "$name" "$status" $((secs / 60)) $((secs % 60))
  SUMMARY+=("$(printf '%-52s %-16s %3dm%02ds' "$name" "$status" $((secs / 60)) $((secs % 60)))")
}

summary() {
  printf '\n== summary (total %dm%02ds)\n' $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60))
  printf '%s\n' "${SUMMARY[@]}"
  if [ "$FAILED" = 0 ]; then echo "ALL PASSED"; else echo "SOME STEPS FAILED"; fi
}

rust_fast_steps() {
  run "cargo fmt --check" cargo fmt --all -- --check
  run "cargo clippy (core, tests, benches)" cargo clippy --all-targets -- -D warnings
  run "cargo clippy (python binding, bench probe)" cargo clippy --features python,bench-probe --lib -- -D warnings
  run "cargo test --release" cargo test --release
}

python_lint_steps() {
  local venv=$1
  run "ruff check (${PY_LINT_PATHS[*]})" "$venv/bin/ruff" check "${PY_LINT_PATHS[@]}"
  run "ruff format --check" "$venv/bin/ruff" format --check "${PY_LINT_PATHS[@]}"
  run "mypy (python/hybrid_alloc)" "$venv/bin/mypy"
  # --no-warn-unused-ignores: the tests' own ignores (type-arg, override) may go unused as the
  # stub changes, and the tests stay as they are; the package itself keeps pyproject's setting.
  run "mypy (tests that use the stub)" env MYPYPATH=python:tests/python/support \
    "$venv/bin/mypy" --no-warn-unused-ignores "${MYPY_TEST_FILES[@]}"
}
