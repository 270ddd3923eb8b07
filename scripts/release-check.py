"""Checks the release artefacts scripts/release-build.sh left in a folder (target/dist), and
prints what it found; exits 1 naming every check that failed.

- The sdist: ``hybrid_alloc-VERSION.tar.gz``, VERSION Cargo.toml's, holding what a build from it
  needs (pyproject.toml, Cargo.toml, Cargo.lock, the Rust and Python sources, README, LICENSE).
- One wheel per Rust target: ``hybrid_alloc-VERSION-cp311-abi3-PLATFORM.whl``, every platform tag
  ``manylinux_2_X_ARCH`` with X at most the policy's (``--compat manylinux_2_28``) and ARCH the
  target's; its WHEEL file carries the same tags, ``Root-Is-Purelib: false`` and maturin's
  version (``--maturin``: the pin the build used, so a pip that ignored the pin shows here).
- ``auditwheel show`` (printed whole) finds each wheel consistent with such a tag.
- No extension module in a wheel needs a glibc symbol version newer than the policy's (read from
  its ELF version-needs section, whatever the target's architecture), and each is built for the
  target's machine.

Usage: python scripts/release-check.py --compat manylinux_2_28 --maturin 1.16.0 --targets
"x86_64-unknown-linux-gnu ..." DIST (needs auditwheel, hence pyelftools: the release tools venv).
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

ROOT = Path(__file__).resolve().parents[1]
# What a build from the sdist reads (beside the whole of rust/ and python/hybrid_alloc/).
SDIST_NEEDS = ("PKG-INFO", "pyproject.toml", "Cargo.toml", "Cargo.lock", "README.md", "LICENSE", "rust/lib.rs")
# The ELF machine of each target's architecture (pyelftools' names), and the wheel tag's arch.
MACHINES = {"x86_64": "EM_X86_64", "aarch64": "EM_AARCH64"}
# The legacy aliases of manylinux_2_X tags (PEP 600).
LEGACY = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}


def glibc(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def platform_glibc(tag: str, arch: str) -> tuple[int, int] | None:
    """The glibc a platform tag promises (``manylinux_2_28_x86_64``: (2, 28)), or None if
    the tag is no manylinux tag of ``arch``."""
    m = re.fullmatch(rf"manylinux_(\d+)_(\d+)_{arch}", tag)
    if m:
        return int(m[1]), int(m[2])
    m = re.fullmatch(rf"(manylinux\d+)_{arch}", tag)
    return (2, LEGACY[m[1]]) if m and m[1] in LEGACY else None


def newest_glibc(so: bytes) -> tuple[str, str, list[str]]:
    """An ELF shared object's machine, the newest GLIBC_x.y it needs and its NEEDED libraries."""
    elf = ELFFile(io.BytesIO(so))
    newest = "0"
    for section in elf.iter_sections():
        if isinstance(section, GNUVerNeedSection):
            for _, auxes in section.iter_versions():
                for aux in auxes:
                    name = aux.name
                    if name.startswith("GLIBC_") and glibc(name[6:]) > glibc(newest):
                        newest = name[6:]
    dynamic = elf.get_section_by_name(".dynamic")
    needed = [t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"] if dynamic else []
    return elf["e_machine"], newest, needed


def check_sdist(dist: Path, version: str, errors: list[str]) -> None:
    sdists = sorted(dist.glob("*.tar.gz"))
    if [p.name for p in sdists] != [f"hybrid_alloc-{version}.tar.gz"]:
        errors.append(f"sdist: expected hybrid_alloc-{version}.tar.gz alone, found {[p.name for p in sdists]}")
        return
    with tarfile.open(sdists[0]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"hybrid_alloc-{version}/PKG-INFO")
        meta = pkg_info.read().decode() if pkg_info else ""
    missing = [n for n in SDIST_NEEDS if n not in names]
    if missing:
        errors.append(f"sdist: lacks {missing}")
    if not any(n.startswith("python/hybrid_alloc/") for n in names):
        errors.append("sdist: lacks python/hybrid_alloc/")
    if f"\nVersion: {version}\n" not in meta:
        errors.append(f"sdist: PKG-INFO does not say Version: {version}")
    print(f"release-check: {sdists[0].name}: {len(names)} files, PKG-INFO version {version}")


def check_wheel(whl: Path, arch: str, compat: tuple[int, int], maturin: str, errors: list[str]) -> None:
    name = whl.name
    parts = name[: -len(".whl")].split("-")
    tags = parts[4].split(".") if len(parts) == 5 else []
    if len(parts) != 5 or parts[2:4] != ["cp311", "abi3"]:
        errors.append(f"{name}: not a cp311-abi3 wheel")
    for tag in tags:
        promised = platform_glibc(tag, arch)
        if promised is None or promised > compat:
            errors.append(f"{name}: platform tag {tag} is not manylinux_2_{compat[1]} ({arch}) or older")
    with zipfile.ZipFile(whl) as z:
        wheel_meta = next((n for n in z.namelist() if n.endswith(".dist-info/WHEEL")), None)
        text = z.read(wheel_meta).decode() if wheel_meta else ""
        sos = {n: z.read(n) for n in z.namelist() if n.endswith(".so")}
    meta_tags = sorted(ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith("Tag: "))
    if meta_tags != sorted(f"cp311-abi3-{t}" for t in tags):
        errors.append(f"{name}: WHEEL's tags {meta_tags} differ from the file name's")
    if "Root-Is-Purelib: false" not in text:
        errors.append(f"{name}: WHEEL does not say Root-Is-Purelib: false")
    if f"Generator: maturin ({maturin})" not in text:
        errors.append(f"{name}: not built by maturin {maturin}: {text.splitlines()[:2]}")
    if list(sos) != ["hybrid_alloc/_core.abi3.so"]:
        errors.append(f"{name}: expected the one extension hybrid_alloc/_core.abi3.so, found {list(sos)}")
    for so_name, so in sos.items():
        machine, newest, needed = newest_glibc(so)
        if machine != MACHINES[arch]:
            errors.append(f"{name}: {so_name} is built for {machine}, not {arch}")
        if glibc(newest) > compat:
            errors.append(f"{name}: {so_name} needs GLIBC_{newest}, newer than GLIBC_{compat[0]}.{compat[1]}")
        print(
            f"release-check: {name}: {so_name}: {machine}, newest glibc symbol version GLIBC_{newest}, needs {needed}"
        )
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(whl)], capture_output=True, text=True, check=False
    )
    print(f"release-check: auditwheel show {name} (exit {shown.returncode}):\n{shown.stdout}{shown.stderr}")
    flat = " ".join(shown.stdout.split())
    m = re.search(r'is consistent with the following platform tag: "([^"]+)"', flat)
    promised = platform_glibc(m[1], arch) if m else None
    if shown.returncode != 0 or promised is None or promised > compat:
        errors.append(f"{name}: auditwheel show does not find it consistent with manylinux_2_{compat[1]} or older")
    print(f"release-check: {name}: tag {'.'.join(tags)}; auditwheel: {m[1] if m else 'no manylinux tag'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compat", default="manylinux_2_28")
    ap.add_argument("--maturin", required=True)
    ap.add_argument("--targets", default="x86_64-unknown-linux-gnu")
    ap.add_argument("dist", type=Path)
    args = ap.parse_args()
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)", args.compat)
    assert m, f"--compat {args.compat}: expected manylinux_X_Y"
    compat = (int(m[1]), int(m[2]))
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    errors: list[str] = []
    check_sdist(args.dist, version, errors)
    wheels = sorted(args.dist.glob("*.whl"))
    for target in args.targets.split():
        arch = target.split("-")[0]
        mine = [w for w in wheels if w.name.endswith(f"_{arch}.whl")]
        if len(mine) != 1 or not mine[0].name.startswith(f"hybrid_alloc-{version}-"):
            errors.append(
                f"{target}: expected one hybrid_alloc-{version} wheel for {arch}, found {[w.name for w in mine]}"
            )
            continue
        check_wheel(mine[0], arch, compat, args.maturin, errors)
    for e in errors:
        print(f"release-check: FAILED: {e}")
    print(f"release-check: {'FAILED' if errors else 'ok'}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
