"""The explorer's prompts: the signal-conditioned context summary, and exploration itself.

Two LLM calls happen per signal. The *summarizer* reads the flagged trajectory and returns
an :class:`~coevolve.shared.messages.ExplorationContext` (JSON, ``CONTEXT_SCHEMA``). Then the
*explorer* acts in a fresh environment, one function call per step (JSON, the schema from
``coevolve.shared.structured.function_call_schema``), steered by a goal written for the
signal's kind: practise a fading skill (forgetting), vary a rarely seen pattern (rare),
probe what separates success from failure (boundary), or settle what the agent was
unsure about (uncertainty). Unguided exploration (seed mode, and the random-exploration
baseline) uses the same loop with a goal that names no signal.

Everything rendered here is cut to a character budget so the prompts fit a small local
model's context.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from coevolve.shared.failures import conversation_before, describe_failure
from coevolve.shared.llm.client import ChatMessages
from coevolve.shared.messages import (
    ChatMessage,
    ExplorationContext,
    FailedCall,
    Signal,
    SignalKind,
    Task,
    Trajectory,
)

MESSAGE_CHARS = 400
TRAJECTORY_CHARS = 3000
TOOL_DESCRIPTION_CHARS = 110
TOOLS_CHARS = 3500
OBSERVATION_CHARS = 600
HISTORY_STEPS = 6
CONVERSATION_CHARS = 1800
STATE_CHARS = 1500


# --------------------------------------------------------------------------- rendering


def clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def render_trajectory(trajectory: Trajectory, max_chars: int = TRAJECTORY_CHARS) -> str:
    """One line per message; when too long, the start and the end are kept (the first
    request and the final outcome say the most), the middle is elided."""
    lines = [_render_message(m) for m in trajectory.messages if m.role != "system"]
    if sum(len(line) + 1 for line in lines) <= max_chars:
        return "\n".join(lines)
    head = lines[:1]
    tail: list[str] = []
    budget = max_chars - len(head[0]) - 40 if head else max_chars
    for line in reversed(lines[1:]):
        if budget - len(line) - 1 < 0:
            break
        tail.insert(0, line)
        budget -= len(line) + 1
    omitted = len(lines) - len(head) - len(tail)
    return "\n".join([*head, f"[... {omitted} messages omitted ...]", *tail])


def _render_message(message: ChatMessage) -> str:
    if message.role == "assistant" and message.tool_calls:
        calls = "; ".join(
            f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in message.tool_calls
        )
        return f"[assistant calls] {clip(calls, MESSAGE_CHARS)}"
    return f"[{message.role}] {clip(message.content, MESSAGE_CHARS)}"


def render_task(task: Task, max_turns: int = 4) -> str:
    turns = [f"{i + 1}. {clip(turn, MESSAGE_CHARS)}" for i, turn in enumerate(task.user_turns)]
    if len(turns) > max_turns:
        turns = [*turns[:max_turns], f"(+{len(turns) - max_turns} more turns)"]
    return "\n".join(turns)


def tool_line(tool: dict[str, Any]) -> str:
    """``name(arg: type, [optional: type]): what it does`` for one function schema."""
    function = tool.get("function", tool)
    parameters = (function.get("parameters") or {}).get("properties") or {}
    required = set((function.get("parameters") or {}).get("required") or [])
    arguments = ", ".join(
        (f"{n}: {s.get('type', 'any')}" if n in required else f"[{n}: {s.get('type', 'any')}]")
        for n, s in parameters.items()
    )
    description = str(function.get("description", ""))
    # BFCL prefixes every description with a sentence about its API class.
    if "Tool description:" in description:
        description = description.split("Tool description:", 1)[1]
    return f"- {function.get('name')}({arguments}): {clip(description, TOOL_DESCRIPTION_CHARS)}"


def render_tools(tools: Sequence[dict[str, Any]], max_chars: int = TOOLS_CHARS) -> str:
    lines: list[str] = []
    used = 0
    for tool in tools:
        line = tool_line(tool)
        if used + len(line) + 1 > max_chars:
            lines.append(f"- ... and {len(tools) - len(lines)} more functions")
            break
        lines.append(line)
        used += len(line) + 1
    return "\n".join(lines)


def render_context(context: ExplorationContext) -> str:
    focus = "\n".join(f"  - {item}" for item in context.focus_pattern)
    avoid = "\n".join(f"  - {item}" for item in context.mistakes_to_avoid)
    return (
        f"Summary: {context.summary}\n"
        f"Failure cause: {context.failure_cause}\n"
        f"Instability pattern: {context.instability_pattern}\n"
        f"Focus on:\n{focus or '  - (none given)'}\n"
        f"Mistakes to avoid:\n{avoid or '  - (none given)'}"
    )


# --------------------------------------------------------------------------- summarizer

CONTEXT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "minLength": 1, "maxLength": 300},
        "failure_cause": {"type": "string", "minLength": 1, "maxLength": 240},
        "instability_pattern": {"type": "string", "minLength": 1, "maxLength": 160},
        "focus_pattern": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 100},
            "minItems": 1,
            "maxItems": 3,
        },
        "mistakes_to_avoid": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 100},
            "maxItems": 3,
        },
    },
    "required": [
        "summary",
        "failure_cause",
        "instability_pattern",
        "focus_pattern",
        "mistakes_to_avoid",
    ],
    "additionalProperties": False,
}

SUMMARIZER_SYSTEM = (
    "You analyse episodes of a tool-using AI agent that is being trained by reinforcement "
    "learning. A monitor flagged the episode below. Write the context that will steer a new "
    "exploration of the same environment, so that the tasks found there teach the agent "
    "what it is missing. Be concrete: name functions, arguments and states."
)

SUMMARIZER_FIELDS = """Answer with one JSON object with these fields, in this order:
- summary: a short recap of the episode (the task, the key actions, how it ended).
- failure_cause: one to three sentences on the root cause of the failure or instability.
- instability_pattern: one or two sentences naming the pattern behind it.
- focus_pattern: a list of the patterns or behaviours to explore again.
- mistakes_to_avoid: a list of the mistakes the exploration must avoid."""


def describe_signal(kind: SignalKind, evidence: dict[str, Any]) -> str:
    """What the signal means for this episode, in words, with its numbers."""
    if kind == "forgetting":
        return (
            "Signal FORGETTING: the agent solved this task recently (a score of "
            f"{_num(evidence.get('best_in_window'))} within its last "
            f"{evidence.get('window_size', '?')} attempts) but now scores "
            f"{_num(evidence.get('current_score'))}. A skill it had is fading."
        )
    if kind == "boundary":
        best = evidence.get("success_actions") or []
        if evidence.get("successes", 1) == 0:
            # the margin rule: attempts that differ, none solved it
            contrast = f" The best attempt called: {', '.join(map(str, best))}." if best else ""
            return (
                f"Signal BOUNDARY: no attempt of one group at this task solved it, but their "
                f"rewards spread by {_num(evidence.get('spread'))}: some got more of it right "
                f"than others. The episode below is the worst attempt.{contrast}"
            )
        contrast = f" A successful attempt called: {', '.join(map(str, best))}." if best else ""
        return (
            f"Signal BOUNDARY: of one group of attempts at this task, "
            f"{evidence.get('successes', '?')} succeeded and {evidence.get('failures', '?')} "
            "failed. The task sits at the edge of what the agent can do; the episode below is "
            f"a failed attempt.{contrast}"
        )
    if kind == "rare":
        return (
            f"Signal RARE: the action pattern `{evidence.get('pattern', '?')}` makes up only "
            f"{_pct(evidence.get('frequency'))} of the agent's actions so far. The agent has "
            "too little experience with it."
        )
    return (
        "Signal UNCERTAINTY: the agent's mean token entropy in this episode "
        f"({_num(evidence.get('mean_entropy'))}) is above the "
        f"{_pct(evidence.get('quantile'))} quantile ({_num(evidence.get('threshold'))}) of "
        "recent episodes: it hesitated about what to do."
    )


def summarizer_messages(signal: Signal, failed: Sequence[FailedCall] = ()) -> ChatMessages:
    """The summarizer's prompt for ``signal`` (ask with ``CONTEXT_SCHEMA``), with what the
    policy got wrong against the ground truth (``failed``)."""
    trajectory = signal.trajectory
    user = (
        f"{describe_signal(signal.kind, signal.evidence)}\n\n"
        f"Task given to the agent:\n{render_task(signal.task)}\n\n"
        f"Episode (reward {_num(trajectory.reward)}):\n{render_trajectory(trajectory)}\n\n"
        f"{render_failure(failed)}"
        "Explain: what happened, why it failed or was unstable, which patterns should be "
        "explored again, and which mistakes to avoid.\n"
        f"{SUMMARIZER_FIELDS}"
    )
    return [{"role": "system", "content": SUMMARIZER_SYSTEM}, {"role": "user", "content": user}]


def _num(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "?"


def _pct(value: object) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "?"


# --------------------------------------------------------------------------- exploration

ACTION_FORMAT = (
    'One JSON object per reply: {"name": "<function name>", "arguments": {<argument>: '
    "<value>, ...}}. Use only the functions listed, with their argument names and types."
)

EXPLORATION_SYSTEM = """You are exploring a software environment through its functions, to \
discover tasks a user could ask for and how to complete them.

In each step:
1. Look at the current state and what the last observation told you.
2. Decide which available function moves the exploration goal forward.
3. Call exactly one function, in the required format.
4. Keep to the area the goal asks you to explore, and cover it thoroughly.

Action format: {action_format}

Rules:
- One action per reply.
- Read the function descriptions and the goal carefully.
- Never call a function that is not listed, and never invent arguments.
- When a call fails, read the error and try a corrected or different call.

Available functions:
{tools}"""

GOAL_TEMPLATES: dict[SignalKind, str] = {
    "forgetting": """Exploration goal: practise a fading skill.
The agent is losing an ability it had. In this exploration:
1. Carry out exactly the operations described in the context below.
2. Repeat them with different argument values.
3. Combine them with related operations.
4. Progress from simple uses to more complex ones.

Context of the forgetting:
{context}

Concentrate on practising these specific operations thoroughly.""",
    "rare": """Exploration goal: gain experience with a rare situation.
The agent has met this situation too rarely. In this exploration:
1. Try variations of the situation described below.
2. Use different combinations of arguments.
3. Probe edge cases and limits.
4. Collect varied examples of this pattern.

Context of the rare situation:
{context}

Try to discover the different forms this situation can take.""",
    "boundary": """Exploration goal: map the boundary between success and failure.
The agent sometimes succeeds and sometimes fails here. In this exploration:
1. Probe the boundary conditions of these operations.
2. Attempt similar tasks with small changes to the arguments.
3. Pay attention to what distinguishes a success from a failure.
4. Collect examples of varying difficulty.

Context of the boundary case:
{context}

Concentrate on what makes the difference between success and failure.""",
    "uncertainty": """Exploration goal: settle what the agent was unsure about.
The agent hesitated in this situation. In this exploration:
1. Inspect the state before acting, the way a careful user would.
2. Try the alternative actions that could plausibly apply here.
3. Check from each observation what the action really did.
4. Collect examples where the right choice is clear from the state.

Context of the uncertain episode:
{context}

Concentrate on making the right action evident from the state.""",
}

# the covered calls an unguided goal names at most (the most recent)
COVERED_CALLS = 24
COVERED_NOTE = (
    "These calls are known already: do not spend the exploration on them. Prefer operations"
    " not listed, above all ones that change the state, with argument values taken from"
    " what the environment holds:"
)

UNGUIDED_GOAL = """Exploration goal: learn what this environment can do.
No feedback about the agent exists yet. In this exploration:
1. Inspect the current state first.
2. Try each kind of operation the functions offer.
3. Chain operations into short, goal-directed sequences a user might ask for.
4. Note what each call returns and how it changes the state.

The environment starts in the state of this scenario:
{scenario}"""


def exploration_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    return EXPLORATION_SYSTEM.format(action_format=ACTION_FORMAT, tools=render_tools(tools))


def exploration_goal(kind: SignalKind, context: ExplorationContext, task: Task) -> str:
    """The signal-kind goal with the summarized context, plus the scenario it came from."""
    goal = GOAL_TEMPLATES[kind].format(context=render_context(context))
    return f"{goal}\n\nThe environment starts in the state of this task:\n{render_task(task)}"


def render_failure(failed: Sequence[FailedCall]) -> str:
    """What the agent got wrong, one line per ground-truth call ("" when nothing)."""
    if not failed:
        return ""
    lines = [f"- {clip(describe_failure(f), MESSAGE_CHARS)}" for f in failed]
    return "Against the correct answer:\n" + "\n".join(lines) + "\n\n"


def render_conversation(
    messages: Sequence[ChatMessage], max_chars: int = CONVERSATION_CHARS
) -> str:
    """The conversation so far, one line per message, its most recent part kept."""
    lines = [_render_message(m) for m in messages if m.role != "system"]
    kept: list[str] = []
    used = 0
    for line in reversed(lines):
        if used + len(line) + 1 > max_chars:
            kept.insert(0, f"[... {len(lines) - len(kept)} earlier messages ...]")
            break
        kept.insert(0, line)
        used += len(line) + 1
    return "\n".join(kept)


def render_state(state: dict[str, Any] | None, max_chars: int = STATE_CHARS) -> str:
    """The environment's state as compact JSON, cut to ``max_chars`` ("" when unknown)."""
    if not state:
        return ""
    text = json.dumps(state, ensure_ascii=False, default=str, separators=(",", ":"))
    return text if len(text) <= max_chars else text[: max_chars - 5] + " ..."


AIMED_GOAL = """Exploration goal: practise exactly what the agent got wrong, with other values.

A user and the agent were in this conversation (the last user message is the request the \
agent failed):
{conversation}

{failure}{signal}
The environment is in the state the agent saw{state_note}
{state}

In this exploration:
1. Call {targets} with OTHER argument values than above that are valid in this state \
(ids, names and amounts that exist in the state or that an earlier call returned).
2. Then, where it makes sense, continue with a call that uses what that call returned.
3. Make the calls a user of this conversation could plausibly ask for next."""


def aimed_goal(
    signal: Signal,
    failed: Sequence[FailedCall],
    state: dict[str, Any] | None,
    context: ExplorationContext | None,
) -> str:
    """The goal of a guided exploration aimed at the failure: the parent turn's
    conversation so far, what the agent got wrong there, the state, and the functions
    to call again with other values."""
    targets = list(dict.fromkeys(f.expected.name for f in failed))
    conversation = conversation_before(signal.task, signal.trajectory.messages)
    signal_words = describe_signal(signal.kind, signal.evidence)
    if context is not None:
        signal_words += "\n" + render_context(context)
    rendered_state = render_state(state)
    return AIMED_GOAL.format(
        conversation=render_conversation(conversation),
        failure=render_failure(failed),
        signal=signal_words + "\n",
        state_note=":" if rendered_state else " (not shown).",
        state=rendered_state,
        targets=" or ".join(targets) if targets else "the functions the request needed",
    )


def unguided_goal(task: Task, covered: Sequence[str] = ()) -> str:
    """The unguided goal from ``task``'s state; ``covered`` calls are named as known
    already, so the exploration looks for other operations."""
    goal = UNGUIDED_GOAL.format(scenario=render_task(task) or render_start_state(task))
    if not covered:
        return goal
    listed = "\n".join(f"- {clip(call, 120)}" for call in covered[-COVERED_CALLS:])
    return f"{goal}\n\n{COVERED_NOTE}\n{listed}"


def render_start_state(task: Task, max_chars: int = STATE_CHARS) -> str:
    """A task with no user turn (an initial state to explore from): its API classes and
    initial configuration, clipped."""
    classes = ", ".join(task.env_config.get("involved_classes") or []) or task.environment
    state = json.dumps(task.initial_state, ensure_ascii=False, default=str)
    return f"No request yet. APIs: {classes}. Initial configuration: {clip(state, max_chars)}"


def exploration_messages(
    tools: Sequence[dict[str, Any]],
    goal: str,
    steps: Sequence[tuple[str, str]] = (),
    max_history: int = HISTORY_STEPS,
    failed: Sequence[str] = (),
    tried: Sequence[str] = (),
) -> ChatMessages:
    """The explorer's prompt for its next action.

    ``steps`` are the (action JSON, observation) pairs of this round so far; only the last
    ``max_history`` stay verbatim, older ones are counted so the model knows they happened.
    ``failed`` are the action JSONs that failed this round, named as not to be repeated;
    ``tried`` the first calls of earlier rounds, named so this round varies their values.
    """
    messages: ChatMessages = [
        {"role": "system", "content": exploration_system_prompt(tools)},
        {"role": "user", "content": goal},
    ]
    dropped = max(0, len(steps) - max_history)
    if dropped:
        messages[1]["content"] += f"\n\n({dropped} earlier steps of this round are not shown.)"
    for action, observation in steps[dropped:]:
        messages.append({"role": "assistant", "content": action})
        messages.append(
            {
                "role": "user",
                "content": f"Observation: {clip(observation, OBSERVATION_CHARS)}\nNext action?",
            }
        )
    notes = []
    if failed:
        notes.append(
            "These calls failed in this round; do not repeat them, try another function or "
            "other arguments:\n" + "\n".join(failed)
        )
    if tried:
        notes.append(
            "Earlier rounds already made these calls; make yours with other argument "
            "values:\n" + "\n".join(tried)
        )
    if notes:
        last = messages[-1]
        last["content"] = "\n\n".join([last["content"], *notes])
    return messages
