"""The judge's round-trip check: can a solver that sees only the request do what the
candidate's calls do?

An LLM (the judge role's) gets each user turn, the conversation before it and the
environment's functions (compact listing), and answers with the calls it would make (one
JSON object, ``{"calls": [...]}``, grammar-constrained to the offered functions). They run
from the task's initial state, turn by turn; the environment then scores the episode
against the candidate's own ground truth (for BFCL: the same final state, and every result
the ground truth returned among the solver's). The criterion ``round_trip`` holds when it
scores 1.0: the request says enough to reproduce the calls, and asks for nothing else.

One LLM call per user turn, so it is off by default (``JudgeConfig.round_trip``);
docs/judge.md has what it adds with the default 0.5B model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from coevolve.services.judge.checks import CheckResult
from coevolve.shared.envs import Environment
from coevolve.shared.envs.rendering import compact_listing
from coevolve.shared.llm import RoleLLM
from coevolve.shared.messages import ChatMessage, Task, ToolCall
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured
from coevolve.shared.structured import function_call_schema as call_schema

MAX_CALLS = 6
CONVERSATION_CHARS = 1500
MESSAGE_CHARS = 300

SOLVER_SYSTEM = (
    "You operate a software environment through its functions for a user. Answer the "
    "user's latest request with the function calls that complete it, in order, using what "
    "the conversation so far tells you. Call only what the request needs."
)


class Plan(msgspec.Struct, forbid_unknown_fields=True):
    calls: list[ToolCall]


def plan_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"calls": [call, ...]}`` with each call one of ``tools`` (at most MAX_CALLS)."""
    return {
        "type": "object",
        "properties": {
            "calls": {
                "type": "array",
                "items": call_schema(tools),
                "minItems": 1,
                "maxItems": MAX_CALLS,
            }
        },
        "required": ["calls"],
        "additionalProperties": False,
    }


def _render(message: ChatMessage) -> str:
    if message.role == "assistant" and message.tool_calls:
        text = "; ".join(
            f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in message.tool_calls
        )
    else:
        text = message.content
    text = " ".join(text.split())
    if len(text) > MESSAGE_CHARS:
        text = text[: MESSAGE_CHARS - 3] + "..."
    return f"[{message.role}] {text}"


def solver_messages(
    tools: list[dict[str, Any]], history: list[ChatMessage], request: str
) -> list[dict[str, str]]:
    """The solver's prompt: the functions, the conversation so far (its end, clipped),
    the request."""
    lines = [_render(m) for m in history]
    kept: list[str] = []
    used = 0
    for line in reversed(lines):
        if used + len(line) > CONVERSATION_CHARS:
            break
        kept.insert(0, line)
        used += len(line) + 1
    conversation = "\n".join(kept) or "(none)"
    user = (
        f"Functions:\n{compact_listing(tools)}\n\n"
        f"Conversation so far:\n{conversation}\n\n"
        f"Request: {request}\n\n"
        'Answer with one JSON object: {"calls": [{"name": ..., "arguments": {...}}, ...]}.'
    )
    return [{"role": "system", "content": SOLVER_SYSTEM}, {"role": "user", "content": user}]


async def round_trip(
    llm: RoleLLM,
    task: Task,
    make_env: Callable[[], Environment],
    *,
    max_tokens: int = 300,
    counter: RejectionCounter | None = None,
) -> CheckResult:
    """Solve ``task`` from its requests alone and score the solver's calls against the
    task's ground truth. Raises only ``LLMUnavailable``."""
    environment = make_env()
    planned = 0
    try:
        history = list(await anyio.to_thread.run_sync(environment.reset, task))
        for request in task.user_turns:
            tools = environment.tools()
            if not tools:
                break
            plan = await ask_structured(
                llm,
                solver_messages(tools, history[:-1], request),
                Plan,
                schema=plan_schema(tools),
                max_tokens=max_tokens,
                temperature=0.0,
                counter=counter,
            )
            if isinstance(plan, Rejection):
                reason = f"round trip: the solver's answer is unusable ({plan.kind})"
                return CheckResult("round_trip", False, [reason], {"calls": planned})
            planned += len(plan.calls)
            for call in plan.calls:
                _, observation = await anyio.to_thread.run_sync(environment.execute, call)
                history.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
                history.append(ChatMessage(role="tool", content=observation))
            step = await anyio.to_thread.run_sync(environment.step, "Done.")
            history.extend(m for m in step.observations if m.role == "user")
        score = await anyio.to_thread.run_sync(environment.score)
        report = getattr(environment, "last_report", None)
        message = str(getattr(report, "message", "") or "")
    finally:
        environment.close()
    passed = score >= 1.0
    reasons = (
        []
        if passed
        else [
            f"round trip: a solver given only the request does not reach the same result "
            f"({message or f'score {score:.2f}'})"
        ]
    )
    return CheckResult("round_trip", passed, reasons, {"calls": planned, "score": score})
