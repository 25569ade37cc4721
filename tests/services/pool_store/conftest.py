"""Fixtures for pool-store tests: a real DuckDB file per test."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Task, ToolCall

TaskFactory = Callable[..., Task]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "pool.duckdb"


@pytest.fixture
def store(db_path: Path) -> Iterator[PoolStore]:
    pool = PoolStore(db_path)
    yield pool
    pool.close()


@pytest.fixture
def make_task() -> TaskFactory:
    """Distinct BFCL-like tasks: each call asks something new unless ``turn`` repeats."""
    counter = itertools.count()

    def factory(**fields: Any) -> Task:
        number = next(counter)
        fields.setdefault("id", f"task-{number}")
        fields.setdefault("environment", "bfcl")
        fields.setdefault("user_turns", [f"Move report_{number}.txt into the archive folder."])
        fields.setdefault("initial_state", {"GorillaFileSystem": {"root": {"workspace": {}}}})
        fields.setdefault(
            "ground_truth",
            [
                [
                    ToolCall(
                        name="mv",
                        arguments={"source": f"report_{number}.txt", "destination": "archive"},
                    )
                ]
            ],
        )
        fields.setdefault("env_config", {"involved_classes": ["GorillaFileSystem"]})
        return Task(**fields)

    return factory
