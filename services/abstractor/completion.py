"""Complete a drafted request with the argument values it leaves out.

A small model often writes "book the flight" for a call that needs a card id and a date.
Such a task asks for hidden information: the agent cannot solve it, and the judge rejects
it (``names_arguments``). The values are in the draft's own calls, so the abstractor adds
each one the request neither writes nor could have seen (in an earlier request or an
earlier call's result) as a "Details:" clause. The judge still checks the result.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from coevolve.shared.argument_values import salient_values
from coevolve.shared.envs import make_environment
from coevolve.shared.messages import Task, ToolCall

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def _numbers(text: str) -> set[float]:
    found: set[float] = set()
    for raw in _NUMBER.findall(text):
        try:
            found.add(float(raw.replace(",", "")))
        except ValueError:
            continue
    return found


def written(value: Any, text: str) -> bool:
    """Whether ``text`` writes ``value`` (a number by value, a string verbatim, any case)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) in _numbers(text)
    return _normal(str(value)) in _normal(text)


def missing_values(call: ToolCall, seen: str) -> list[tuple[str, Any]]:
    """(parameter, value) of each salient argument of ``call`` that ``seen`` does not write."""
    return [
        (parameter, value)
        for _, parameter, value in salient_values([call])
        if not written(value, seen)
    ]


def unstated_values(
    request: str, calls: Sequence[ToolCall], observations: Sequence[str], context: str = ""
) -> list[tuple[str, Any]]:
    """(parameter, value) of each salient argument of ``calls`` that neither ``request``,
    nor ``context`` (the conversation before it), nor an earlier call's result writes: what
    a user who said only this request has not told the assistant."""
    missing: list[tuple[str, Any]] = []
    shown = [context, request]
    for call, observation in zip(calls, [*observations, *[""] * len(calls)], strict=False):
        for parameter, value in missing_values(call, "\n".join(shown)):
            if all(value != known for _, known in missing):
                missing.append((parameter, value))
        shown.append(observation)
    return missing


def details_clause(missing: Sequence[tuple[str, Any]]) -> str:
    """``Details: card id 'card_3'; amount 250.`` (strings quoted, as BFCL's requests do)."""
    parts = [f"{parameter.replace('_', ' ')} {value!r}" for parameter, value in missing]
    return f"Details: {'; '.join(parts)}."


def complete_requests(task: Task) -> tuple[Task, int]:
    """``task`` with each user turn completed by the values its calls use but nothing shown
    before them writes, and how many values were added. The calls are replayed from the
    task's initial state so that a value an earlier call returned (a booking id, a token)
    counts as shown. Blocking (run it in a worker thread)."""
    environment = make_environment(task.environment)
    try:
        environment.reset(task)
        replayed = environment.replay([list(turn) for turn in task.ground_truth])
    finally:
        environment.close()
    observations = list(replayed.observations)
    shown: list[str] = []
    turns: list[str] = []
    added = 0
    for request, calls in zip(task.user_turns, task.ground_truth, strict=True):
        returned, observations = observations[: len(calls)], observations[len(calls) :]
        missing = unstated_values(request, calls, returned, "\n".join(shown))
        shown.extend([request, *returned])
        added += len(missing)
        turns.append(f"{request.rstrip()} {details_clause(missing)}" if missing else request)
    return msgspec.structs.replace(task, user_turns=turns), added
