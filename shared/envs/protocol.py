"""The environment protocol every environment implements (BFCL first; AppWorld, users' own).

An episode is: ``reset(task)`` -> the first user message(s); then ``step(assistant_text)``
until ``done``; then ``score()`` in [0, 1]. ``tools()`` may change during an episode (BFCL's
miss_func category reveals functions at a later turn), so call it before every generation.
``replay`` runs a known action sequence (a task's ground truth, or a candidate task's
minimal action sequence) turn by turn, for sanity checks and for judging synthesized tasks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import msgspec

from coevolve.shared.messages import ChatMessage, Task, ToolCall


class StepResult(msgspec.Struct, kw_only=True):
    """What one assistant message caused.

    ``observations``: one ``role="tool"`` message per attempted call (its result or a clear
    error), then, if the turn advanced, the next ``role="user"`` message.
    ``info`` has at least ``calls`` (names executed), ``errors`` (strings) and ``turn``.
    """

    observations: list[ChatMessage]
    done: bool
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class ReplayResult(msgspec.Struct, kw_only=True):
    """Outcome of replaying an action sequence: ``ok`` when every call ran without error."""

    ok: bool
    observations: list[str]
    errors: list[str]
    state_changed: bool


@runtime_checkable
class Environment(Protocol):
    name: str

    def reset(self, task: Task) -> list[ChatMessage]:
        """Fresh instances from ``task.initial_state``; returns the first user message(s)."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """OpenAI-style schemas ``{"type": "function", "function": {name, description,
        parameters}}`` of the functions the agent may call right now."""
        ...

    def step(self, assistant_text: str) -> StepResult:
        """Parse ``<tool_call>`` blocks, validate and dispatch them; plain text ends the turn."""
        ...

    def execute(self, call: ToolCall) -> tuple[bool, str]:
        """Validated dispatch of one parsed call in the current turn: (ok, observation)."""
        ...

    def replay(self, ground_truth: list[list[ToolCall]]) -> ReplayResult:
        """Run ``ground_truth[i]`` as turn i (one step per turn), from the current turn on."""
        ...

    def score(self) -> float:
        """The episode's score in [0, 1]."""
        ...

    def partial_credit(self) -> float:
        """How close an unsolved episode came, in [0, 1] (reward shaping for training;
        ``score`` stays the verdict)."""
        ...

    def close(self) -> None: ...


def state_of(environment: Environment) -> dict[str, Any] | None:
    """The environment's comparable state (BFCL: its API instances' public attributes)
    when it offers ``state()``; None for an environment that does not."""
    state = getattr(environment, "state", None)
    if not callable(state):
        return None
    value = state()
    return dict(value) if isinstance(value, Mapping) else None


def argument_values_of(environment: Environment, function: str, parameter: str) -> list[Any]:
    """Values the environment knows ``function``'s ``parameter`` takes, when it offers
    ``argument_values()`` (BFCL: what its train split's ground truth passes); else []."""
    values = getattr(environment, "argument_values", None)
    return list(values(function, parameter)) if callable(values) else []
