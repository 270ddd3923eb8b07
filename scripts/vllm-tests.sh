#!/usr/bin/env bash
# vLLM's own tests of the KV cache manager and scheduler (tests/v1/core/ of a supported release)
# against hybrid_alloc's manager: the gate a vLLM maintainer or vendor would run first.
# Usage: scripts/vllm-tests.sh RELEASE [PYTEST_ARGS...]
#
# The tests come from the release's sdist on PyPI, fetched once into a cache by
# scripts/vllm-tests.py (the repository holds no copy). They run in the release's test
# environment (scripts/test-env.sh; PYTHON overrides its interpreter) with the plugin on
# (HYBRID_ALLOC=1) through tests/python/support/vllm_core_gate.py, which also binds
# vllm.v1.core.kv_cache_manager.KVCacheManager to the plugin's factory (the tests build managers
# directly too), deselects tests/vllm_core_exclusions.txt's entries for the release, and prints,
# per file, passed / failed / skipped / excluded and which manager each test built.
# hybrid_alloc comes from PYTHONPATH when it already has it (scripts/test.sh), else from
# scripts/install-local.sh (a release build into target/pysite). Extra arguments go to pytest
# (e.g. a file below tests/v1/core/, or -k); without any, every test of tests/v1/core/ runs.
# HYBRID_ALLOC_GATE_JSON=PATH writes the summary as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
RELEASE=${1:?usage: scripts/vllm-tests.sh RELEASE [PYTEST_ARGS...]}
shift
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  PY=$(bash scripts/test-env.sh "$RELEASE" | tail -n 1)/bin/python
fi
if ! PYTHONPATH=${PYTHONPATH:-} "$PY" -c 'import hybrid_alloc._core' 2>/dev/null; then
  SITE=$(bash scripts/install-local.sh "$PY" | tail -n 1)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
DIR=$("$PY" scripts/vllm-tests.py "$RELEASE")
if [ $# -eq 0 ]; then set -- tests/v1/core; fi
cd "$DIR"
export PYTHONPATH="$REPO/tests/python/support:$PYTHONPATH"
HYBRID_ALLOC_REQUIRE_VLLM=$RELEASE HF_HUB_OFFLINE=1 exec "$PY" -m pytest -p vllm_core_gate \
  -p no:cacheprovider -q -rfE -W ignore::DeprecationWarning -W ignore::FutureWarning "$@"
