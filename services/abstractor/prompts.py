"""The abstractor's prompt: exploration tuples -> task candidates, and their JSON schema.

The LLM reads the (history, action, observation) tuples of an exploration and returns up
to a few tasks, each a description, the user turns, and per turn the minimal sequence of
calls that completes it. The initial state is not the LLM's to invent: a candidate starts
from the state the exploration started from. :func:`draft_problems` finds what makes a
draft unusable (calls to functions that do not exist, turns without a matching action
list), and :func:`draft_to_task` builds the candidate :class:`Task` with its lineage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from coevolve.shared.messages import (
    Exploration,
    Lineage,
    Origin,
    Task,
    ToolCall,
    derived_id,
)
from coevolve.shared.structured import function_call_schema

ChatMessages = list[dict[str, str]]

MAX_TASKS = 3
MAX_TURNS = 3
MAX_CALLS_PER_TURN = 5
MIN_REQUEST_WORDS = 3
STEP_CHARS = 500
EXPLORATION_CHARS = 5000


class DraftTurn(msgspec.Struct, forbid_unknown_fields=True):
    request: str
    calls: list[ToolCall]


class CandidateDraft(msgspec.Struct, forbid_unknown_fields=True):
    """One drafted task. Each turn carries its request and its calls together, so the
    grammar cannot produce more requests than call lists (a 0.5B model did, in 4 of 6
    drafts of a default run)."""

    description: str
    turns: list[DraftTurn]

    @property
    def user_turns(self) -> list[str]:
        return [turn.request for turn in self.turns]

    @property
    def ground_truth(self) -> list[list[ToolCall]]:
        return [list(turn.calls) for turn in self.turns]


class AbstractionOutput(msgspec.Struct, forbid_unknown_fields=True):
    tasks: list[CandidateDraft]


def candidate_schema(
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    max_tasks: int = MAX_TASKS,
    max_turns: int = MAX_TURNS,
    max_calls_per_turn: int = MAX_CALLS_PER_TURN,
) -> dict[str, Any]:
    """Schema of :class:`AbstractionOutput`. With ``tools``, each call is constrained to
    an existing function and its argument schema."""
    call: dict[str, Any] = (
        function_call_schema(list(tools))
        if tools
        else {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64},
                "arguments": {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
    )
    turn = {
        "type": "object",
        "properties": {
            "request": {"type": "string", "minLength": 1, "maxLength": 240},
            "calls": {
                "type": "array",
                "items": call,
                "minItems": 1,
                "maxItems": max_calls_per_turn,
            },
        },
        "required": ["request", "calls"],
        "additionalProperties": False,
    }
    draft = {
        "type": "object",
        "properties": {
            "description": {"type": "string", "minLength": 1, "maxLength": 200},
            "turns": {"type": "array", "items": turn, "minItems": 1, "maxItems": max_turns},
        },
        "required": ["description", "turns"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "tasks": {"type": "array", "items": draft, "minItems": 1, "maxItems": max_tasks}
        },
        "required": ["tasks"],
        "additionalProperties": False,
    }


ABSTRACTOR_SYSTEM = (
    "You turn logs of an exploration of a software environment into training tasks for a "
    "tool-using AI agent. Each task is what a user would ask, with the exact function calls "
    "that accomplish it."
)

ABSTRACTOR_INSTRUCTIONS = """Steps:
1. Read the interaction tuples (action, observation) below.
2. Find the goals the explorer actually accomplished: calls that succeeded and changed the \
state or returned what a user would want.
3. For each goal write a task: a one-sentence description and its turns; each turn is a \
user request (phrased as a user would, with every value its calls need) and the minimal \
list of calls that completes it.

Rules:
- Keep goal-directed steps; leave out random or failed attempts.
- Use only calls that succeeded in the log, with the same function names and arguments.
- A request must contain every value its calls use; never rely on hidden information.
- Prefer multi-step tasks that connect several operations over single trivial calls.
- At most {max_tasks} tasks.

Answer with one JSON object: "tasks", a list of tasks, each with "description" (one \
sentence) and "turns": a list of {{"request": <the user's request>, "calls": [{{"name": \
<function>, "arguments": {{<argument>: <value>}}}}, ...]}}.

A request is plain English a person would say, never a function name or a log line."""


def render_exploration(exploration: Exploration, max_chars: int = EXPLORATION_CHARS) -> str:
    """The tuples round by round, one line each, cut to ``max_chars`` (later steps first
    to go: the start of each round sets the scene)."""
    lines: list[str] = []
    for number, round_ in enumerate(exploration.rounds, start=1):
        lines.append(f"Round {number}:")
        for step_number, step in enumerate(round_.steps, start=1):
            action = f"{step.action.name}({json.dumps(step.action.arguments, ensure_ascii=False)})"
            observation = " ".join(step.observation.split())
            line = f"  {step_number}. {action} -> {observation}"
            lines.append(line if len(line) <= STEP_CHARS else line[: STEP_CHARS - 3] + "...")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 20] + "\n[... cut ...]"


def abstraction_messages(exploration: Exploration, max_tasks: int = MAX_TASKS) -> ChatMessages:
    """The abstractor's prompt (ask with :func:`candidate_schema`)."""
    scenario = "\n".join(f"- {turn}" for turn in exploration.task.user_turns[:2])
    goal = ""
    if exploration.context is not None:
        goal = f"\nThe exploration focused on: {'; '.join(exploration.context.focus_pattern)}\n"
    user = (
        f"The environment started in the state of this scenario:\n{scenario}\n{goal}\n"
        f"Exploration log:\n{render_exploration(exploration)}\n\n"
        f"{ABSTRACTOR_INSTRUCTIONS.format(max_tasks=max_tasks)}"
    )
    return [{"role": "system", "content": ABSTRACTOR_SYSTEM}, {"role": "user", "content": user}]


def request_words(request: str, functions: set[str]) -> list[str]:
    """The request's plain words: letters only, not a function's name. A 0.5B model wrote
    the requests "authenticate_travel" and "get_exchange_rate({}) -> {'exchanged_value':
    0.5}" for tasks the judge accepted once their values were filled in."""
    words = re.findall(r"[A-Za-z0-9_']+", request)
    return [w for w in words if re.fullmatch(r"[A-Za-z][a-z']*", w) and w not in functions]


def draft_problems(draft: CandidateDraft, known_functions: set[str]) -> list[str]:
    """Why ``draft`` cannot become a task; [] when it can."""
    problems: list[str] = []
    if not draft.description.strip():
        problems.append("empty description")
    if not draft.user_turns or any(not turn.strip() for turn in draft.user_turns):
        problems.append("missing or empty user turn")
    elif any(
        len(request_words(turn, known_functions)) < MIN_REQUEST_WORDS for turn in draft.user_turns
    ):
        problems.append(f"a request of fewer than {MIN_REQUEST_WORDS} plain words")
    if not draft.turns or not all(turn.calls for turn in draft.turns):
        problems.append("a turn without calls")
    unknown = sorted({call.name for turn in draft.ground_truth for call in turn} - known_functions)
    if unknown:
        problems.append(f"calls functions that do not exist: {', '.join(unknown)}")
    return problems


def draft_to_task(
    draft: CandidateDraft,
    exploration: Exploration,
    index: int,
    *,
    origin: Origin | None = None,
    signal_evidence: dict[str, Any] | None = None,
) -> Task:
    """The candidate task: the draft's turns and calls, from the exploration's start state.

    Ids derive from the exploration id and the draft's position, so abstracting a
    redelivered exploration yields the same ids. Guided explorations make "synthesized"
    tasks and unguided ones "explored" tasks unless ``origin`` says otherwise.
    """
    source = exploration.task
    candidate_id = derived_id("candidate", exploration.id, index)
    lineage = Lineage(
        signal_id=exploration.signal_id,
        signal_kind=exploration.signal_kind,
        signal_evidence=dict(signal_evidence or {}),
        parent_task_id=source.id,
        context=exploration.context,
        exploration_id=exploration.id,
        exploration_mode=exploration.mode,
        exploration_steps=sum(len(r.steps) for r in exploration.rounds),
        candidate_id=candidate_id,
    )
    return Task(
        id=derived_id("task", candidate_id),
        environment=source.environment,
        user_turns=list(draft.user_turns),
        initial_state=source.initial_state,
        ground_truth=[list(turn) for turn in draft.ground_truth],
        env_config=source.env_config,
        origin=origin or ("synthesized" if exploration.mode == "guided" else "explored"),
        description=draft.description,
        source_entry=source.source_entry,
        lineage=lineage,
    )
