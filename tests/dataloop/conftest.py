"""Data-loop tests run their actors on asyncio (anyio's pytest plugin)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
