"""Environments behind one protocol, and a registry to create them by name.

``make_environment("bfcl")`` returns a fresh BFCL multi-turn environment; register your own
with ``register_environment(name, factory)`` (see docs/environments.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coevolve.shared.envs.protocol import Environment, ReplayResult, StepResult, state_of

EnvironmentFactory = Callable[..., Environment]

_REGISTRY: dict[str, EnvironmentFactory] = {}


class UnknownEnvironmentError(KeyError):
    """No environment is registered under the requested name."""


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Make ``make_environment(name, **options)`` call ``factory(**options)``."""
    _REGISTRY[name] = factory


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


def _make_bfcl(**options: Any) -> Environment:
    # Imported on first use so that importing the registry stays cheap.
    from coevolve.shared.envs.bfcl.environment import BfclEnvironment

    return BfclEnvironment(**options)


register_environment("bfcl", _make_bfcl)

__all__ = [
    "Environment",
    "EnvironmentFactory",
    "ReplayResult",
    "StepResult",
    "UnknownEnvironmentError",
    "available_environments",
    "make_environment",
    "register_environment",
    "state_of",
]
