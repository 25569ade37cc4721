"""Repair a draft against its exploration log: calls that only failed there are dropped,
calls that produced a value the draft uses are put back.

A small model copies failed attempts into its drafts although it is told not to; a call
identical to one that failed in the log, and never succeeded there, is left out (unless
it is the turn's only call: then the judge decides).

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


def producing_step(value: object, steps: list[InteractionStep]) -> InteractionStep | None:
    """The first successful step whose observation writes ``value`` (a string of
    ``MIN_CHARS`` or more characters that its own arguments do not already contain)."""
    if not isinstance(value, str) or len(value) < MIN_CHARS:
        return None
    for step in steps:
        passed = {v for _, _, v in salient_values([step.action])}
        if value in step.observation and value not in passed and step.ok:
            return step
    return None


def without_failed_calls(task: Task, exploration: Exploration) -> tuple[Task, int]:
    """``task`` without the calls that only failed in the exploration, and how many."""
    steps = [step for round_ in exploration.rounds for step in round_.steps]
    succeeded = [step.action for step in steps if step.ok]
    failed = [step.action for step in steps if not step.ok]
    turns: list[list[ToolCall]] = []
    dropped = 0
    for calls in task.ground_truth:
        kept = [call for call in calls if call not in failed or call in succeeded]
        if not kept:
            kept = list(calls)
        dropped += len(calls) - len(kept)
        turns.append(kept)
    if not dropped:
        return task, 0
    return msgspec.structs.replace(task, ground_truth=turns), dropped


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
