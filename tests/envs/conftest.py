"""Shared fixtures for the environment tests: real BFCL tasks, fresh environments."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coevolve.shared.envs.bfcl import BfclEnvironment, load_tasks
from coevolve.shared.envs.rendering import configure_tool_rendering, configured_tool_rendering
from coevolve.shared.messages import Task


@pytest.fixture(scope="session")
def base_tasks() -> list[Task]:
    return load_tasks("multi_turn_base")


@pytest.fixture
def env() -> BfclEnvironment:
    return BfclEnvironment()


def task_by_id(tasks: list[Task], entry_id: str) -> Task:
    return next(task for task in tasks if task.id == entry_id)


def first_task_with_class(tasks: list[Task], class_name: str) -> Task:
    return next(t for t in tasks if class_name in t.env_config["involved_classes"])


@pytest.fixture(autouse=True)
def restore_tool_rendering() -> Iterator[None]:
    """Tests that configure a tool rendering (or run a command that does) leave none behind."""
    before = configured_tool_rendering()
    yield
    configure_tool_rendering(before)
