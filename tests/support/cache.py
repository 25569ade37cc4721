"""Where the tests keep what is slow to make (the converted model, similarity models):
``runs/test-cache`` of the checkout, ignored by git, or ``COEVOLVE_TEST_CACHE``."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("COEVOLVE_TEST_CACHE", ROOT / "runs/test-cache"))
