"""The distiller's prompt, the JSON schema of its answer and how the answer is read.

The distiller sees the task's request, the functions the attempts called, and two
attempts of the same group side by side (the best and the worst, each step's call and
the answer it got, and each attempt's reward). It answers ``{"insight": "..."}``: one
piece of advice that would have turned the worse attempt into the better one, written
for similar tasks, not for this one's values.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coevolve.shared.attribution.prompt import clip, render_request, render_steps
from coevolve.shared.attribution.steps import policy_steps
from coevolve.shared.llm.client import ChatMessages
from coevolve.shared.messages import Task, Trajectory
from coevolve.shared.structured import Rejection, parse_structured

INSIGHT_MIN_CHARS = 20
INSIGHT_MAX_CHARS = 300
INSIGHT_TOKENS = 120


class Insight(msgspec.Struct, forbid_unknown_fields=True):
    insight: str


def insight_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            # no minLength/maxLength: a bounded repetition of 300 makes a grammar the
            # llama.cpp server falls over on; max_tokens bounds it and parse_insight checks
            "insight": {"type": "string"}
        },
        "required": ["insight"],
        "additionalProperties": False,
    }


SYSTEM = (
    "You coach a tool-using AI agent. From two attempts at the same request, one better "
    "than the other, you write one short piece of advice the agent can reuse on similar "
    "requests."
)

# no worked example: the 0.5B role model copied one verbatim, whatever its domain
INSTRUCTIONS = """Compare the two attempts. Write the one rule that made the better attempt \
better, for requests like this one: one sentence of at most 30 words, starting "When asked \
to", that names the functions the agent should call (or not call) and in which order, or \
where an argument's value comes from. Write function names alone, without arguments, \
brackets or quotes. Do not mention rewards or attempts.

Answer with one JSON object: {"insight": "When asked to ..."}"""


def render_attempt(label: str, trajectory: Trajectory) -> str:
    steps = policy_steps(trajectory)
    body = render_steps(steps) if steps else "(no step)"
    return f"{label} attempt (reward {trajectory.reward:.2f}):\n{body}"


def distil_messages(
    task: Task, better: Trajectory, worse: Trajectory, functions: list[str]
) -> ChatMessages:
    """The distiller's prompt for one group's ``better`` and ``worse`` attempts (ask with
    ``insight_schema()``, read with ``parse_insight``)."""
    parts = [f"User request:\n{render_request(task)}"]
    if functions:
        parts.append(f"Functions the attempts called: {clip(', '.join(functions), 400)}")
    parts.append(render_attempt("Better", better))
    parts.append(render_attempt("Worse", worse))
    parts.append(INSTRUCTIONS)
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def parse_insight(text: str, finish_reason: str = "stop") -> str | Rejection:
    """The distiller's advice, whitespace folded, or why it cannot be used."""
    # a small model's grammar-bound string may still hold a raw line break, which JSON
    # does not allow inside a string: one sentence needs none
    parsed = parse_structured(" ".join(text.splitlines()), Insight, finish_reason=finish_reason)
    if isinstance(parsed, Rejection):
        return parsed
    insight = " ".join(parsed.insight.split())
    if len(insight) < INSIGHT_MIN_CHARS:
        return Rejection("too_short", f"{len(insight)} characters: {insight!r}")
    if len(insight) > INSIGHT_MAX_CHARS:  # clipped, it would end mid-sentence
        return Rejection("too_long", f"{len(insight)} characters: {insight[:80]!r}...")
    return insight
