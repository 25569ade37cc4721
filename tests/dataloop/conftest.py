"""Data-loop tests run their actors on asyncio (anyio's pytest plugin) and share a seed task."""

from __future__ import annotations

import pytest

from coevolve.shared.messages import Task
from tests.dataloop.dataloop_harness import filesystem_seed_tasks


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def seed_task() -> Task:
    """One train-split file-system task of the seed pool."""
    return filesystem_seed_tasks(1)[0]
