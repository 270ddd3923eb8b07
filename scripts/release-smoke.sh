#!/usr/bin/env bash
# Installs the release wheel (target/dist, from scripts/release-build.sh) into a fresh venv beside
# an installed vLLM, and runs tests/python/wheel there: the package and its compiled core come from
# that venv, the plugin's entry point (vllm.general_plugins) and the `hybrid-alloc` console script
# are registered, `hybrid-alloc --help` runs, and vLLM's real Scheduler schedules through the
# plugin (HYBRID_ALLOC=1); and tests/python/core/test_packaging.py (version, license, extras, readme)
# on the installed metadata. Usage: scripts/release-smoke.sh VLLM_VENV [WHEEL] (a test environment
# of scripts/test-env.sh; WHEEL defaults to target/dist's wheel for this machine's architecture).
#
# The fresh venv (target/dist-venv) is made from the vLLM venv's base interpreter and gets the
# wheel FILE by `pip install --no-deps --no-index`: pip checks its tags against this platform,
# unpacks it, writes the console script and the metadata vLLM's plugin loader reads, as it does
# for a user. vLLM (several GB, minutes to install) is not installed again: one .pth file
# (`import site; site.addsitedir(...)`) puts the vLLM venv's site-packages behind the fresh
# venv's own, as if vLLM were installed there, and the vLLM venv itself stays untouched.
# (`--system-site-packages` would not do: it exposes the base interpreter's packages, not a
# venv's.) PYTHONPATH is cleared for every step (pip too), so no checkout's build (target/pysite) can stand in for the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
# Without PYTHONPATH for every step: pip would otherwise see the checkout's own build (test.sh
# exports target/pysite) as hybrid-alloc 0.1.0 already installed and install nothing.
unset PYTHONPATH
VLLM_VENV=$1
WHEEL=${2:-$(ls target/dist/hybrid_alloc-*-cp311-abi3-*_"$(uname -m)".whl)}
FRESH=target/dist-venv
rm -rf "$FRESH"
"$VLLM_VENV/bin/python" -m venv "$FRESH"
"$FRESH/bin/python" -m pip install -q --no-deps --no-index "$WHEEL"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
echo "import site; site.addsitedir('$(purelib "$VLLM_VENV/bin/python")')" \
  >"$(purelib "$FRESH/bin/python")/hybrid_alloc_smoke_vllm.pth"
echo "release-smoke: $(basename "$WHEEL") installed into $FRESH, beside $VLLM_VENV's vLLM"
env HYBRID_ALLOC_WHEEL="$(readlink -f "$WHEEL")" HYBRID_ALLOC_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 \
  "$FRESH/bin/python" -m pytest tests/python/wheel tests/python/core/test_packaging.py -p no:cacheprovider \
  -W ignore::DeprecationWarning -q
