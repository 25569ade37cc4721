"""What the policy got wrong in one trajectory, call by call, against the task's ground truth.

A signal's trajectory is a failed (or unstable) attempt at a task whose ground truth is
known. Synthesis aims at the failure only when it knows which ground-truth call the
policy missed, made with other arguments, replaced by another function, or made out of
order; :func:`failed_calls` says that, turn by turn. The policy's own calls are those of
the assistant messages after the conversation prefix the environment replayed (the
task's prior turns), split into turns at each later user message.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from coevolve.shared.messages import ChatMessage, FailedCall, Task, ToolCall, Trajectory

# a trajectory scoring at least this solved its task: nothing in it failed
SOLVED_REWARD = 1.0


def _normal(value: Any) -> Any:
    """A value as compared: numbers by value, strings without case and outer spaces."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return " ".join(value.split()).lower()
    if isinstance(value, Mapping):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def same_call(expected: ToolCall, made: ToolCall) -> bool:
    """``made`` is ``expected``: the same function, and every argument the ground truth
    gives has the same value (an argument it leaves to its default may be given)."""
    if expected.name != made.name:
        return False
    return all(
        key in made.arguments and _normal(made.arguments[key]) == _normal(value)
        for key, value in expected.arguments.items()
    )


def request_position(task: Task, messages: Sequence[ChatMessage]) -> int | None:
    """Where ``task``'s first request stands in ``messages``: the first user message after
    the replayed prefix's (``env_config.prior_turns``); None when there is none."""
    prefix_users = len(task.env_config.get("prior_turns") or [])
    users = (i for i, message in enumerate(messages) if message.role == "user")
    return next(itertools.islice(users, prefix_users, None), None)


def policy_turns(task: Task, messages: Sequence[ChatMessage]) -> list[list[ToolCall]]:
    """The policy's calls in each of ``task``'s turns: the assistant calls after the
    replayed prefix (``env_config.prior_turns``), split at each later user message."""
    start = request_position(task, messages)
    turns: list[list[ToolCall]] = []
    for message in messages[start:] if start is not None else ():
        if message.role == "user":
            turns.append([])
        elif message.role == "assistant":
            turns[-1].extend(message.tool_calls)
    return turns


def failed_in_turn(expected: Sequence[ToolCall], made: Sequence[ToolCall]) -> list[FailedCall]:
    """The ground-truth calls of one turn that ``made`` did not make as it should have.

    Each expected call first takes the earliest unused call equal to it; one taken
    before an earlier expected call's match was made out of order. What is left unmatched
    pairs with a made call of the same function (other arguments), else with the next
    unused made call (another function), else it was missed.
    """
    used: set[int] = set()
    matched: list[int | None] = []
    for call in expected:
        index = next((i for i, m in enumerate(made) if i not in used and same_call(call, m)), None)
        if index is not None:
            used.add(index)
        matched.append(index)
    failed: list[tuple[int, FailedCall]] = []
    last = -1
    for position, (call, index) in enumerate(zip(expected, matched, strict=True)):
        if index is None:
            continue
        if index < last:
            failed.append(
                (position, FailedCall(expected=call, problem="wrong_order", got=made[index]))
            )
        last = max(last, index)
    for position, (call, index) in enumerate(zip(expected, matched, strict=True)):
        if index is not None:
            continue
        same_name = next(
            (i for i, m in enumerate(made) if i not in used and m.name == call.name), None
        )
        other = next((i for i in range(len(made)) if i not in used), None)
        if same_name is not None:
            used.add(same_name)
            wrong = FailedCall(expected=call, problem="wrong_arguments", got=made[same_name])
        elif other is not None:
            used.add(other)
            wrong = FailedCall(expected=call, problem="wrong_function", got=made[other])
        else:
            wrong = FailedCall(expected=call, problem="missed")
        failed.append((position, wrong))
    return [wrong for _, wrong in sorted(failed, key=lambda item: item[0])]


def failed_calls(task: Task, trajectory: Trajectory) -> list[FailedCall]:
    """What ``trajectory`` got wrong against ``task``'s ground truth, in ground-truth
    order; [] when it solved the task or the task has no ground truth."""
    if trajectory.reward >= SOLVED_REWARD or not task.ground_truth:
        return []
    made = policy_turns(task, trajectory.messages)
    failed: list[FailedCall] = []
    for turn, expected in enumerate(task.ground_truth):
        failed.extend(failed_in_turn(expected, made[turn] if turn < len(made) else []))
    return failed


def target_functions(failed: Sequence[FailedCall]) -> list[str]:
    """The functions of the failed calls, in order, each once."""
    return list(dict.fromkeys(f.expected.name for f in failed))


def call_text(call: ToolCall) -> str:
    """``name(key=value, ...)`` with JSON values, as prompts show a call."""
    arguments = ", ".join(
        f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in call.arguments.items()
    )
    return f"{call.name}({arguments})"


def describe_failure(failed: FailedCall) -> str:
    """One failed call in words, for a prompt."""
    expected = call_text(failed.expected)
    if failed.problem == "missed":
        return f"it never called {expected}"
    got = call_text(failed.got) if failed.got is not None else "nothing"
    if failed.problem == "wrong_arguments":
        return f"it called {got} instead of {expected} (wrong arguments)"
    if failed.problem == "wrong_function":
        return f"it called {got} where {expected} was needed (wrong function)"
    return f"it called {expected} too early, before the calls it depends on (wrong order)"


def conversation_before(task: Task, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The conversation the policy was given: ``messages`` up to and including the task's
    first request (the replayed prefix, then the request), without the system prompt."""
    start = request_position(task, messages)
    given = messages if start is None else messages[: start + 1]
    return [message for message in given if message.role != "system"]
