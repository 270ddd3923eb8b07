"""The installed-wheel tests run only where scripts/release-smoke.sh runs them: in a fresh venv
holding the release wheel, beside an installed vLLM, with ``HYBRID_ALLOC_WHEEL`` naming the
wheel file. Any other pytest run (the test suite's, against ``target/pysite``) leaves them out."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("HYBRID_ALLOC_WHEEL") else ["test_installed_wheel.py"]
