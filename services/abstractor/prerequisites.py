"""Put back the calls a draft needs but left out: those that produced a value it uses.

An exploration logs in (``authenticate_travel`` returns a token), then books a flight with
that token. A small model drafts the booking alone; replayed from the start state, the
token is unknown and the call fails. The value's origin is in the exploration log, so
the abstractor inserts the step whose result wrote the value right before the first call
that uses it. Only values of ``MIN_CHARS`` or more characters (tokens, ids) are traced,
and only to a step that succeeded.
"""

from __future__ import annotations

import msgspec

from coevolve.shared.argument_values import salient_values
from coevolve.shared.messages import Exploration, InteractionStep, Task, ToolCall

MIN_CHARS = 6


def _failed(observation: str) -> bool:
    return observation.lstrip().startswith('{"error"')


def producing_step(value: object, steps: list[InteractionStep]) -> InteractionStep | None:
    """The first successful step whose observation writes ``value`` (a string of
    ``MIN_CHARS`` or more characters that its own arguments do not already contain)."""
    if not isinstance(value, str) or len(value) < MIN_CHARS:
        return None
    for step in steps:
        passed = {v for _, _, v in salient_values([step.action])}
        if value in step.observation and value not in passed and not _failed(step.observation):
            return step
    return None


def with_prerequisites(task: Task, exploration: Exploration) -> tuple[Task, int]:
    """``task`` with each call's missing producer inserted before it, and how many were
    inserted. A call already in the task (earlier in it) is not inserted again."""
    steps = [step for round_ in exploration.rounds for step in round_.steps]
    done: list[ToolCall] = []
    turns: list[list[ToolCall]] = []
    inserted = 0
    for calls in task.ground_truth:
        turn: list[ToolCall] = []
        for call in calls:
            for _, _, value in salient_values([call]):
                step = producing_step(value, steps)
                if step is not None and step.action not in done and step.action != call:
                    turn.append(step.action)
                    done.append(step.action)
                    inserted += 1
            turn.append(call)
            done.append(call)
        turns.append(turn)
    if not inserted:
        return task, 0
    return msgspec.structs.replace(task, ground_truth=turns), inserted
