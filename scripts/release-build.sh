#!/usr/bin/env bash
# Builds the release artefacts into target/dist and checks them (scripts/release-check.py):
#   hybrid_alloc-VERSION.tar.gz                                  the sdist (`maturin sdist`)
#   hybrid_alloc-VERSION-cp311-abi3-manylinux_2_28_x86_64.whl    the wheel, built FROM that sdist
# The wheel is what PyPI takes and what installs wherever vLLM's own wheels do (vLLM 0.34.0 ships
# manylinux_2_28 for x86_64 and aarch64): `maturin build` on this machine (glibc 2.36) tags it
# manylinux_2_34, and `pip wheel .` linux_x86_64 (PyPI refuses it). So the link goes through zig
# (`--zig`, PyPI's ziglang), which links against glibc 2.28's symbols, and maturin's auditwheel
# check (`--compatibility manylinux_2_28`) refuses anything newer.
#
# The wheel is built by pip from the sdist file, with build isolation, as `pip install
# hybrid_alloc-VERSION.tar.gz` does for a user on a platform without a wheel: pip unpacks it into
# a temporary folder and builds it in a fresh environment holding only pyproject.toml's
# build-system requirement (maturin, pinned below by PIP_CONSTRAINT), with a fresh cargo target
# folder and Cargo.lock as is (`--locked`). One build therefore proves that the sdist builds from
# scratch and gives the wheel that ships.
#
# The tools (maturin, ziglang, auditwheel; pinned) live in their own venv, cached beside the test
# environments (HYBRID_ALLOC_VENV_DIR, default ~/.cache/hybrid_alloc; about 0.5 GB, most of it
# zig's libraries). HYBRID_ALLOC_RELEASE_TARGETS lists the Rust targets to build (default the
# host's, x86_64-unknown-linux-gnu); aarch64-unknown-linux-gnu cross-builds through the same zig
# once `rustup target add aarch64-unknown-linux-gnu` has installed its standard library
# (docs/install.md). Usage: scripts/release-build.sh (PYTHON, default python3 >= 3.11, makes the
# tools venv). Prints the wheels' paths on its last lines.
set -euo pipefail
cd "$(dirname "$0")/.."
MATURIN_PIN=maturin==1.16.0
TOOLS_PINS=("$MATURIN_PIN" ziglang==0.17.1 auditwheel==6.8.2)
COMPAT=manylinux_2_28
TARGETS=${HYBRID_ALLOC_RELEASE_TARGETS:-x86_64-unknown-linux-gnu}
PY=${PYTHON:-python3}
DIST=target/dist

pyver=$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
TOOLS=$(readlink -m "${HYBRID_ALLOC_VENV_DIR:-$HOME/.cache/hybrid_alloc}/venv-release-py$pyver")
STAMP="$TOOLS/.hybrid_alloc-release-tools"
if [ "$(cat "$STAMP" 2>/dev/null)" != "${TOOLS_PINS[*]}" ]; then
  echo "release-build: making the tools venv $TOOLS (${TOOLS_PINS[*]})" >&2
  rm -rf "$TOOLS"
  $PY -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q "${TOOLS_PINS[@]}" >&2
  echo "${TOOLS_PINS[*]}" >"$STAMP"
fi
# maturin looks for `zig` on PATH; ziglang ships the binary inside its package.
ZIGDIR="$TOOLS/zig-bin"
mkdir -p "$ZIGDIR"
ln -sf "$("$TOOLS/bin/python" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')/zig" "$ZIGDIR/zig"
export PATH="$ZIGDIR:$TOOLS/bin:$PATH"

for target in $TARGETS; do
  [ "$target" = "$(rustc -vV | sed -n 's/^host: //p')" ] && continue
  rustup target list --installed 2>/dev/null | grep -qx "$target" || {
    echo "release-build: no Rust standard library for $target: run \`rustup target add $target\` (docs/install.md)" >&2
    exit 1
  }
done

rm -rf "$DIST"
mkdir -p "$DIST"
maturin sdist -o "$DIST" >&2
SDIST=$(ls "$DIST"/*.tar.gz)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$MATURIN_PIN" >"$constraints"
# A cargo target folder set in the environment would be reused: the build starts from nothing.
unset CARGO_TARGET_DIR
# pip files the wheels it builds from an sdist named NAME-VERSION.tar.gz in its cache, keyed by the
# file's path alone: the build's pip keeps a cache of its own (that, and maturin's download), so
# these builds stay out of the user's.
for target in $TARGETS; do
  echo "release-build: $target wheel from $SDIST ($COMPAT, zig)" >&2
  PIP_CACHE_DIR="$TOOLS/pip-cache" PIP_CONSTRAINT=$constraints \
    MATURIN_PEP517_ARGS="--zig --compatibility $COMPAT --target $target --locked" \
    "$TOOLS/bin/python" -m pip wheel -q --no-deps -w "$DIST" "$SDIST" >&2
done
"$TOOLS/bin/python" scripts/release-check.py --compat "$COMPAT" --maturin "${MATURIN_PIN#maturin==}" \
  --targets "$TARGETS" "$DIST" >&2
ls "$PWD/$DIST"/*.whl
