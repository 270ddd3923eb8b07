import sys
from pathlib import Path

# The vLLM harness of the tests builds both managers from one KVCacheConfig.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
