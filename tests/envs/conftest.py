"""Shared fixtures for the environment tests: real BFCL tasks, fresh environments."""

from __future__ import annotations

import pytest

from coevolve.shared.envs.bfcl import BfclEnvironment, load_tasks
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
