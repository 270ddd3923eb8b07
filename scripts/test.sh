#!/usr/bin/env bash
# Runs every test: Rust (fmt, clippy, cargo test in release and in debug with overflow checks),
# the wheel build, ruff (lint with import sorting, and format --check) over the Python paths, mypy
# over python/hybrid_alloc and over the tests that use the stub, the stub check, and pytest with the
# parity tests against the real vLLM, once for each supported release (each in a cached venv built
# by scripts/test-env.sh; a run whose vLLM tests would be skipped fails instead), and each release's
# own tests of the manager and scheduler against ours (scripts/vllm-tests.sh, the "gate" runs). The
# releases' pytest runs go concurrently, each into target/test-logs/pytest-RELEASE[-PART].log,
# printed whole when it ends. The steps it shares with scripts/check.sh (its fast half) live in scripts/steps.sh.
#
# HYBRID_ALLOC_VLLM_RELEASES narrows the releases (default: every supported release, read from
# python/hybrid_alloc/vllm/releases.py; scripts/test-env.sh refuses any other); extra arguments go
# to pytest. The property tests bound their own cases in debug builds (tests/model.rs, `cases()`);
# HYBRID_ALLOC_DEBUG_PROPTEST_CASES, if set, overrides that count in the debug run only (it becomes
# PROPTEST_CASES there; the release run keeps the tests' own default). Every step runs even if an earlier
# one failed (except what needs the wheel); the summary at the end gives each step's status and
# time, and the exit status is 0 only if every step passed. The test environments build in the
# background while the Rust steps run; the summary gives each one's own build time (0m00s when it
# was cached) and how long the run then waited for it.
#
# pytest's exit status 5 ("no tests collected") counts as a pass only when arguments select a
# subset (e.g. `-k engine` on a release that has no engine tests); for the whole suite it fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
RELEASES=${HYBRID_ALLOC_VLLM_RELEASES:-$(${PYTHON:-python3} python/hybrid_alloc/vllm/releases.py)}
DEBUG_CASES=${HYBRID_ALLOC_DEBUG_PROPTEST_CASES:-}
PROGRESS_EVERY=${HYBRID_ALLOC_PROGRESS_EVERY:-120}
LOGDIR=target/test-logs
mkdir -p "$LOGDIR"
# shellcheck source=scripts/steps.sh
source scripts/steps.sh

# The vLLM environments download several GB the first time: build them in the background while
# the Rust steps run (each release's log in target/test-logs/).
# Each build writes its own duration (from its start to its end) next to its log, so the summary
# shows how long it took, not how long the run waited for it.
declare -A ENV_PID
for release in $RELEASES; do
  rm -f "$LOGDIR/test-env-$release.secs"
  (
    start=$SECONDS
    bash scripts/test-env.sh "$release" >"$LOGDIR/test-env-$release.log" 2>&1
    rc=$?
    echo $((SECONDS - start)) >"$LOGDIR/test-env-$release.secs"
    exit "$rc"
  ) &
  ENV_PID[$release]=$!
done

rust_fast_steps
if [ -n "$DEBUG_CASES" ]; then
  run "cargo test (debug, PROPTEST_CASES=$DEBUG_CASES)" env PROPTEST_CASES="$DEBUG_CASES" cargo test
else
  run "cargo test (debug: overflow checks, debug asserts)" cargo test
fi

# The random-trace parity tests (test_parity_vllm/_mamba/_rswa) run every configuration on every
# release, 20,000 operations each (HYBRID_ALLOC_PARITY_OPS sets another length). They ran 100,000
# in every CI before 0.34 was added; with three releases side by side on two cores, 100,000 on
# 0.34.0 and 20,000 on the others took CI's fresh-clone run to 47 minutes, and 40,000 on 0.34.0
# (with the engine tests queued behind 0.32.0's other tests) to 50 (2026-12-03). Fewer than about
# 20,000 leave some configurations without the evictions, resets or preemptions their tests
# assert happened.
parity_ops() {
  echo "${HYBRID_ALLOC_PARITY_OPS:-20000}"
}

# vLLM's own tests of the manager and scheduler (tests/v1/core/ of the release's sdist, fetched
# once into the cache by scripts/vllm-tests.py) against ours: scripts/vllm-tests.sh. CI runs the
# files whose tests build a KVCacheManager or a Scheduler (the others test vLLM's planner, encoder
# cache, metrics, outputs and its own single-type managers, never a manager the plugin builds:
# the gate's summary counts them "built none"), less the six "standard" 20,000-step random soaks
# of test_priority_scheduler_random.py (their six "preemption" siblings, the same soak under
# block pressure, run), and test_kv_cache_utils.py's test_is_kv_cache_spec_uniform, which builds
# no manager and ends in a `python -O` subprocess importing vLLM under a 60-second timeout (with
# the other lanes beside it on two cores the import took longer: CI failed on it, 2026-12-06);
# `bash scripts/vllm-tests.sh RELEASE` runs them all (docs/development.md).
GATE_CI_ARGS=(-k "not (test_priority_scheduling_blast and standard) and not test_is_kv_cache_spec_uniform")
for f in test_encoder_cache_manager test_kv_cache_config_builder test_kv_cache_metrics test_kv_cache_planning \
  test_kv_sharing test_output test_prompt_block_hash_vectors test_repetition_detection \
  test_single_type_kv_cache_manager prefix_cache/test_partial_prefix_cache_primitives; do
  GATE_CI_ARGS+=("--ignore=tests/v1/core/$f.py")
done

# One pytest run of a release: PART "all" (every test, or what the arguments select), "main" (all
# but tests/python/engine), "engine" (tests/python/engine, the real-engine tests) or "gate"
# (vLLM's own tests/v1/core/ against ours, above).
pytest_release() {
  local release=$1 part=$2 py=$3 rc paths
  shift 3
  if [ "$part" = gate ]; then
    PYTHON=$py bash scripts/vllm-tests.sh "$release" "${GATE_CI_ARGS[@]}" --durations=10
    return
  fi
  case $part in
    all) paths=(tests/python) ;;
    main) paths=(tests/python --ignore=tests/python/engine) ;;
    engine) paths=(tests/python/engine) ;;
  esac
  [ "$part" = engine ] || echo "random-trace parity: $(parity_ops "$release") operations per configuration on vLLM $release"
  HYBRID_ALLOC_PARITY_OPS=$(parity_ops "$release") \
    HYBRID_ALLOC_REQUIRE_VLLM=$release HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    "$py" -m pytest "${paths[@]}" -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning --durations=15 "$@"
  rc=$?
  if [ "$rc" = 5 ] && [ $# -gt 0 ]; then
    echo "pytest: no test selected by '$*' on vLLM $release (counted as a pass: the arguments chose a subset)"
    return 0
  fi
  return "$rc"
}

first=1
declare -A PYTEST_PID
RUNS=()
for release in $RELEASES; do
  start=$SECONDS
  printf '\n== test environment (vLLM %s) (%s)\n' "$release" "$(date +%T)"
  wait "${ENV_PID[$release]}"
  rc=$?
  waited=$((SECONDS - start))
  cat "$LOGDIR/test-env-$release.log"
  built=$(cat "$LOGDIR/test-env-$release.secs" 2>/dev/null || echo "$waited")
  how=cached
  grep -q '^test-env: building' "$LOGDIR/test-env-$release.log" && how="built in the background"
  record "test environment (vLLM $release, $how; waited $((waited / 60))m$(printf %02d $((waited % 60)))s)" "$rc" "$built"
  [ "$rc" = 0 ] || continue
  VENV=$(tail -n 1 "$LOGDIR/test-env-$release.log")
  PY="$VENV/bin/python"
  if [ $first = 1 ]; then
    first=0
    start=$SECONDS
    printf '\n== wheel build (maturin) and install into target/pysite (%s)\n' "$(date +%T)"
    SITE=$(bash scripts/install-local.sh "$PY" | tail -n 1)
    rc=$?
    record "wheel build and install" "$rc" $((SECONDS - start))
    if [ "$rc" != 0 ]; then
      summary
      exit 1
    fi
    python_lint_steps "$VENV"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    run "stubs (mypy.stubtest)" bash -c 'cd /tmp && "$0" -m mypy.stubtest hybrid_alloc._core' "$PY"
  fi
  # The releases' pytest runs go concurrently (each is mostly one busy process; two cores), each
  # into its own log, printed whole when it ends; each writes its own duration next to its log.
  # Without arguments the real-engine tests (tests/python/engine: minutes each, where the
  # release's build runs an engine) are a run of their own beside the rest of the release's
  # tests, so they do not queue behind them (2026-12-03: one run of both took 50 minutes), and so
  # is the release's gate (vLLM's own tests/v1/core/, GATE_CI_ARGS above).
  if [ $# -gt 0 ]; then parts=(all); else parts=(main engine gate); fi
  for part in "${parts[@]}"; do
    run_name=$release
    [ "$part" = main ] || [ "$part" = all ] || run_name=$release-$part
    printf '\n== pytest (vLLM %s) started (%s); log %s (progress below every %ss, the whole log when it ends)\n' \
      "$run_name" "$(date +%T)" "$LOGDIR/pytest-$run_name.log" "$PROGRESS_EVERY"
    rm -f "$LOGDIR/pytest-$run_name.secs"
    (
      start=$SECONDS
      pytest_release "$release" "$part" "$PY" "$@" >"$LOGDIR/pytest-$run_name.log" 2>&1
      rc=$?
      echo $((SECONDS - start)) >"$LOGDIR/pytest-$run_name.secs"
      exit "$rc"
    ) &
    PYTEST_PID[$run_name]=$!
    RUNS+=("$run_name")
  done
done
# The release artefacts, while the pytest runs go on: scripts/release-build.sh (the sdist, the
# manylinux_2_28 wheel pip builds from it, `auditwheel show`), then that wheel installed into a
# fresh venv beside the last release's vLLM (scripts/release-smoke.sh: the plugin's entry point,
# `hybrid-alloc --help`, one scheduler step through the plugin).
if [ $first = 0 ]; then
  run "release build (sdist, manylinux_2_28 wheel, auditwheel)" bash scripts/release-build.sh &&
    run "release wheel in a fresh venv beside vLLM ($(basename "$VENV"))" bash scripts/release-smoke.sh "$VENV"
fi
# While they run, one line every PROGRESS_EVERY seconds: each release's pytest percentage and the
# file it is in (read from its log), so a run that takes most of an hour shows it is moving.
progress() {
  local release log line file pct
  line="$(date +%T) pytest progress:"
  for release in "${RUNS[@]}"; do
    log=$LOGDIR/pytest-$release.log
    [ -n "${PYTEST_PID[$release]:-}" ] && [ -f "$log" ] || continue
    if [ -f "$LOGDIR/pytest-$release.secs" ]; then
      line+=" $release done;"
      continue
    fi
    pct=$(grep -o '\[ *[0-9]*%\]' "$log" | tail -n 1 | tr -d '[] ')
    file=$(grep -o '^tests/[^ ]*\.py' "$log" | tail -n 1)
    line+=" $release ${pct:-0%} ${file:-(collecting)};"
  done
  echo "$line"
}
running() {
  local release
  for release in "${RUNS[@]}"; do
    [ -n "${PYTEST_PID[$release]:-}" ] || continue
    [ -f "$LOGDIR/pytest-$release.secs" ] || return 0
  done
  return 1
}
while running; do
  for ((i = 0; i < PROGRESS_EVERY && ${#PYTEST_PID[@]} > 0; i += 5)); do
    running || break
    sleep 5
  done
  running && progress
done
for release in "${RUNS[@]}"; do
  [ -n "${PYTEST_PID[$release]:-}" ] || continue
  wait "${PYTEST_PID[$release]}"
  rc=$?
  printf '\n== pytest (vLLM %s) (ended; log %s)\n' "$release" "$LOGDIR/pytest-$release.log"
  cat "$LOGDIR/pytest-$release.log"
  record "pytest (vLLM $release)" "$rc" "$(cat "$LOGDIR/pytest-$release.secs" 2>/dev/null || echo 0)"
done
[ $first = 0 ] || { echo "no test environment could be built"; FAILED=1; }
summary
exit "$FAILED"
