"""The judge's prompt: five criteria over a replayed candidate task -> accept or reject.

The judge sees the candidate (description, user turns, ground-truth calls) next to what
replaying those calls in a fresh environment returned, and rates five criteria:
API matching, parameter usage, logical flow, final result, and the absence of failed or
skipped steps. Every criterion is phrased so that ``true`` is good; :func:`decide` accepts
only when the model says accept *and* every criterion holds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from coevolve.shared.llm.client import ChatMessages
from coevolve.shared.messages import Task, ToolCall

CRITERIA: tuple[str, ...] = (
    "api_matching",
    "parameter_usage",
    "logical_flow",
    "final_result",
    "no_failed_or_skipped_steps",
)
OBSERVATION_CHARS = 300
REASON_CHARS = 300


class Criteria(msgspec.Struct, forbid_unknown_fields=True):
    api_matching: bool
    parameter_usage: bool
    logical_flow: bool
    final_result: bool
    no_failed_or_skipped_steps: bool


class Judgment(msgspec.Struct, forbid_unknown_fields=True):
    criteria: Criteria
    accept: bool
    reason: str


JUDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "criteria": {
            "type": "object",
            "properties": {name: {"type": "boolean"} for name in CRITERIA},
            "required": list(CRITERIA),
            "additionalProperties": False,
        },
        "accept": {"type": "boolean"},
        "reason": {"type": "string", "minLength": 1, "maxLength": REASON_CHARS},
    },
    "required": ["criteria", "accept", "reason"],
    "additionalProperties": False,
}

JUDGE_SYSTEM = (
    "You check training tasks for a tool-using AI agent. Each task has user requests and a "
    "reference solution: the function calls that should complete them. The calls were "
    "replayed in the real environment; you see what each returned. Decide whether the "
    "reference solution really completes the task."
)

JUDGE_INSTRUCTIONS = """Rate each criterion true (satisfied) or false:
1. api_matching: the calls use the functions the requests require.
2. parameter_usage: every argument is correct, complete, and stated in (or follows from) \
the requests.
3. logical_flow: the steps come in a sensible order, with nothing unreasonable skipped.
4. final_result: the final state and returned results achieve what the requests ask, \
including all information the user wanted.
5. no_failed_or_skipped_steps: no call failed, was skipped, or was invalid.

Do not accept a task whose required function was never called, whose arguments are wrong, \
or whose result was not achieved, even if the intent looks right. Ignore connection \
timeouts.

Answer with one JSON object: "criteria" (each of the five names above with true or \
false), then "accept" (true only if the reference solution completes the task), then \
"reason" (one or two sentences referring to the criteria)."""


def _call_text(call: ToolCall) -> str:
    return f"{call.name}({json.dumps(call.arguments, ensure_ascii=False, sort_keys=True)})"


def render_replay(task: Task, observations: Sequence[str], errors: Sequence[str] = ()) -> str:
    """Each turn's request, then each of its calls with what the replay returned.

    ``observations`` are the replay's results in call order across all turns (as
    ``ReplayResult.observations``); missing ones show as "(not executed)".
    """
    lines: list[str] = []
    position = 0
    for number, turn in enumerate(task.user_turns, start=1):
        lines.append(f"Turn {number} request: {turn}")
        calls = task.ground_truth[number - 1] if number - 1 < len(task.ground_truth) else []
        if not calls:
            lines.append("  (no calls)")
        for call in calls:
            result = observations[position] if position < len(observations) else "(not executed)"
            result = " ".join(result.split())
            if len(result) > OBSERVATION_CHARS:
                result = result[: OBSERVATION_CHARS - 3] + "..."
            lines.append(f"  call {_call_text(call)}\n    -> {result}")
            position += 1
    if errors:
        lines.append("Replay errors:")
        lines.extend(f"  - {error}" for error in errors)
    return "\n".join(lines)


def judge_messages(
    task: Task,
    observations: Sequence[str],
    errors: Sequence[str] = (),
    self_score: float | None = None,
) -> ChatMessages:
    """The judge's prompt (ask with ``JUDGE_SCHEMA``, decode as :class:`Judgment`)."""
    checks = ""
    if self_score is not None:
        checks = (
            f"\nAutomatic check: the replayed solution scores {self_score:.2f} against itself.\n"
        )
    user = (
        f"Task description: {task.description or '(none)'}\n\n"
        f"{render_replay(task, observations, errors)}\n{checks}\n{JUDGE_INSTRUCTIONS}"
    )
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def decide(judgment: Judgment) -> tuple[bool, list[str], dict[str, bool]]:
    """(accepted, reasons, criteria): accepted only if the judge accepts and every
    criterion holds; reasons lead with the judge's own, then any failed criterion."""
    criteria = {name: bool(getattr(judgment.criteria, name)) for name in CRITERIA}
    failed = [name for name, ok in criteria.items() if not ok]
    reasons = [judgment.reason.strip() or "(no reason given)"]
    reasons.extend(f"criterion failed: {name}" for name in failed)
    if not judgment.accept:
        reasons.append("judge rejected the task")
    elif failed:
        reasons.append("judge accepted, but criteria failed: rejected")
    return judgment.accept and not failed, reasons, criteria
