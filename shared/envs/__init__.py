"""Environments behind one protocol, and a registry to create them by name.

``make_environment("bfcl")`` returns a fresh BFCL multi-turn environment; register your own
with ``register_environment(name, factory, starts)`` (see docs/environments.md).
``start_tasks(name)`` are the environment's initial states as tasks with nothing to answer
(no user turn, no ground truth): where unguided exploration starts when nobody labelled
the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coevolve.shared.envs.protocol import Environment, ReplayResult, StepResult, state_of
from coevolve.shared.messages import Task

EnvironmentFactory = Callable[..., Environment]
# the environment's initial states as tasks with no user turn and no ground truth
StartTasks = Callable[[], list[Task]]

_REGISTRY: dict[str, EnvironmentFactory] = {}
_STARTS: dict[str, StartTasks] = {}


class UnknownEnvironmentError(KeyError):
    """No environment is registered under the requested name."""


def register_environment(
    name: str, factory: EnvironmentFactory, starts: StartTasks | None = None
) -> None:
    """Make ``make_environment(name, **options)`` call ``factory(**options)`` and
    ``start_tasks(name)`` call ``starts()``."""
    _REGISTRY[name] = factory
    if starts is not None:
        _STARTS[name] = starts
    else:
        _STARTS.pop(name, None)


def start_tasks(name: str) -> list[Task]:
    """The initial states unguided exploration of environment ``name`` starts from."""
    if name not in _REGISTRY:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered: {available_environments()}"
        )
    starts = _STARTS.get(name)
    if starts is None:
        raise UnknownEnvironmentError(f"environment {name!r} registered no initial states")
    return starts()


def available_environments() -> list[str]:
    return sorted(_REGISTRY)


def make_environment(name: str, **options: Any) -> Environment:
    """A new, independent environment instance (one per concurrent episode)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered: {available_environments()}"
        ) from None
    return factory(**options)


def initial_tools(task: Task) -> list[dict[str, Any]]:
    """The function schemas ``task``'s environment offers from its initial state (resets
    a fresh environment on the task: blocking, run it in a worker thread)."""
    environment = make_environment(task.environment)
    try:
        environment.reset(task)
        return environment.tools()
    finally:
        environment.close()


def _make_bfcl(**options: Any) -> Environment:
    # Imported on first use so that importing the registry stays cheap.
    from coevolve.shared.envs.bfcl.environment import BfclEnvironment

    return BfclEnvironment(**options)


def _bfcl_starts() -> list[Task]:
    from coevolve.shared.envs.bfcl.tasks import state_tasks

    return state_tasks()


register_environment("bfcl", _make_bfcl, _bfcl_starts)

__all__ = [
    "Environment",
    "EnvironmentFactory",
    "ReplayResult",
    "StartTasks",
    "StepResult",
    "UnknownEnvironmentError",
    "available_environments",
    "initial_tools",
    "make_environment",
    "register_environment",
    "start_tasks",
    "state_of",
]
