"""The attributor's prompt, the JSON schema of its answer and how the answer is read.

The attributor sees the task's request, each step of one trajectory numbered (the call it
made or the text it wrote, and the answer it got, both shortened), the final reward and,
when the task has one, the expected calls. It answers ``{"labels": [{"step": 1,
"verdict": "GOOD"}, ...]}`` with exactly one entry per step: ``labels_schema`` pins the
count (``minItems`` = ``maxItems``), which llama-cpp-python's server turns into a grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from coevolve.shared.attribution.steps import Step
from coevolve.shared.failures import call_text
from coevolve.shared.llm.client import ChatMessages
from coevolve.shared.messages import ChatMessage, Task, Trajectory
from coevolve.shared.structured import Rejection, parse_structured

Verdict = Literal["GOOD", "BAD"]
VERDICT_VALUES: dict[str, int] = {"GOOD": 1, "BAD": -1}

ACTION_CHARS = 300
ANSWER_CHARS = 200
REQUEST_CHARS = 600


class StepVerdict(msgspec.Struct, forbid_unknown_fields=True):
    step: int
    verdict: Verdict


class StepVerdicts(msgspec.Struct, forbid_unknown_fields=True):
    labels: list[StepVerdict]


def labels_schema(steps: int) -> dict[str, Any]:
    """The answer's schema for a trajectory of ``steps`` steps (at least 1)."""
    if steps < 1:
        raise ValueError("a trajectory with no step has nothing to label")
    return {
        "type": "object",
        "properties": {
            "labels": {
                "type": "array",
                "minItems": steps,
                "maxItems": steps,
                "items": {
                    "type": "object",
                    "properties": {
                        "step": {"type": "integer", "minimum": 1, "maximum": steps},
                        "verdict": {"type": "string", "enum": list(VERDICT_VALUES)},
                    },
                    "required": ["step", "verdict"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["labels"],
        "additionalProperties": False,
    }


def label_tokens(steps: int) -> int:
    """Completion tokens an answer for ``steps`` steps needs, with room to spare
    (``{"step": 12, "verdict": "GOOD"}`` is about 12 tokens)."""
    return 24 + 16 * steps


def labels_of(verdicts: StepVerdicts, steps: int) -> list[int] | Rejection:
    """+1 (GOOD) / -1 (BAD) per step, in step order; a rejection unless the labels number
    the steps 1..``steps`` once each."""
    numbers = [v.step for v in verdicts.labels]
    if len(numbers) != steps:
        return Rejection("wrong_count", f"{len(numbers)} labels for {steps} steps")
    if sorted(numbers) != list(range(1, steps + 1)):
        return Rejection("wrong_steps", f"labels for steps {numbers}, not 1..{steps}")
    by_step = {v.step: VERDICT_VALUES[v.verdict] for v in verdicts.labels}
    return [by_step[number] for number in range(1, steps + 1)]


def parse_labels(text: str, steps: int, finish_reason: str = "stop") -> list[int] | Rejection:
    """The attributor's answer as one label per step, or why it cannot be used."""
    parsed = parse_structured(text, StepVerdicts, finish_reason=finish_reason)
    if isinstance(parsed, Rejection):
        return parsed
    return labels_of(parsed, steps)


SYSTEM = (
    "You review the steps of a tool-using AI agent after an episode. For each step you "
    "decide whether it helped complete the user's request (GOOD) or not (BAD)."
)

INSTRUCTIONS = """Label every step from 1 to {steps}:
- GOOD: it moved the agent towards completing the request: a needed call with the right \
arguments, a needed look-up, a correct final answer.
- BAD: it did not: a wrong or unneeded call, wrong or made-up arguments, repeating a call \
that failed, text where a call was needed, giving up.
Judge each step by what it did, not only by the final reward: a failed episode can hold \
good steps and a successful one bad steps.

Answer with one JSON object: {{"labels": [{{"step": 1, "verdict": "GOOD" or "BAD"}}, ...]}} \
with exactly {steps} entries, in step order."""


def clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def render_action(message: ChatMessage) -> str:
    if message.tool_calls:
        calls = "; ".join(call_text(call) for call in message.tool_calls)
        return f"calls {clip(calls, ACTION_CHARS)}"
    return f"writes: {clip(message.content, ACTION_CHARS) or '(nothing)'}"


def render_answer(message: ChatMessage) -> str:
    who = "result" if message.role == "tool" else message.role
    return f"   -> {who}: {clip(message.content, ANSWER_CHARS) or '(empty)'}"


def render_steps(steps: Sequence[Step]) -> str:
    lines: list[str] = []
    for number, step in enumerate(steps, start=1):
        lines.append(f"Step {number}: {render_action(step.action)}")
        lines.extend(render_answer(answer) for answer in step.answers)
    return "\n".join(lines)


def render_request(task: Task) -> str:
    turns = [clip(turn, REQUEST_CHARS) for turn in task.user_turns]
    if len(turns) == 1:
        return turns[0]
    return "\n".join(f"Turn {number}: {turn}" for number, turn in enumerate(turns, start=1))


def render_expected(task: Task) -> str | None:
    """The ground truth's calls turn by turn (None: the task has none)."""
    if not any(task.ground_truth):
        return None
    lines = []
    for number, calls in enumerate(task.ground_truth, start=1):
        shown = "; ".join(call_text(call) for call in calls) or "(no call)"
        lines.append(f"Turn {number}: {clip(shown, ACTION_CHARS * 2)}")
    return "\n".join(lines)


def attribution_messages(task: Task, trajectory: Trajectory, steps: Sequence[Step]) -> ChatMessages:
    """The attributor's prompt for ``trajectory``'s ``steps`` (ask with
    ``labels_schema(len(steps))``, read with ``parse_labels``)."""
    parts = [f"User request:\n{render_request(task)}"]
    expected = render_expected(task)
    if expected is not None:
        parts.append(f"Expected calls (a reference solution):\n{expected}")
    parts.append(f"The agent's steps:\n{render_steps(steps)}")
    parts.append(
        f"Final reward: {trajectory.reward:.2f} (1.00: the request was fully completed; "
        "less: it was not, with some credit for correct calls)."
    )
    parts.append(INSTRUCTIONS.format(steps=len(steps)))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
