"""Multi-step exploration: an LLM acting in a fresh environment, one function call a step.

Each round resets a new environment from the task's initial state. At every step the
explorer role is asked for one call as JSON constrained to the environment's current
function schemas (``function_call_schema``), the call goes through the tool-call protocol
(``<tool_call>`` text into ``Environment.step``), and the step is recorded as an
:class:`~coevolve.shared.messages.InteractionStep` (history before the action, the action,
its observation). An unusable answer is a counted rejection that uses up the step; it
never ends the exploration early. A call that already failed in the round is not run
again: the model is asked once more, and a second repeat is a ``repeated_call``
rejection. A round's first call that repeats, with the same arguments, an earlier
round's first call is restricted to the other values the state holds for one of its
parameters (``variants.py``); where it holds none, a repeat is asked for again once,
warmer, then run. :class:`~coevolve.shared.llm.LLMUnavailable` propagates: the caller
retries the whole exploration later.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.prompts import exploration_messages
from coevolve.services.explorer.variants import varied_tools
from coevolve.shared.envs import Environment, state_of
from coevolve.shared.llm import RoleLLM
from coevolve.shared.llm.client import ChatMessages
from coevolve.shared.messages import ChatMessage, ExplorationRound, InteractionStep, Task, ToolCall
from coevolve.shared.structured import (
    Rejection,
    RejectionCounter,
    ask_structured,
    function_call_schema,
)
from coevolve.shared.toolcalls import format_tool_call

log = logging.getLogger(__name__)


# each recorded step's history: every message cut to this many characters
HISTORY_CHARS = 2000
# added to the temperature when the model is asked again after repeating a failed call
REPEAT_TEMPERATURE_BOOST = 0.5


@dataclass
class ExplorationStats:
    steps: int = 0
    failed_calls: int = 0
    rejections: list[Rejection] = field(default_factory=list)


class _SchemaCache:
    """``function_call_schema`` per set of offered functions (tools rarely change)."""

    def __init__(self) -> None:
        self._schemas: dict[tuple[str, ...], dict[str, Any]] = {}

    def get(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        key = tuple(str(tool.get("function", tool).get("name")) for tool in tools)
        schema = self._schemas.get(key)
        if schema is None:
            schema = self._schemas[key] = function_call_schema(tools)
        return schema


def call_json(call: ToolCall) -> str:
    """A call as the explorer's prompt shows it (and as repeats are recognised)."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, sort_keys=True)


def clipped(messages: list[ChatMessage], limit: int) -> list[ChatMessage]:
    """``messages`` with each content cut to ``limit`` characters: every step carries its
    history, so long observations would otherwise repeat in every later step."""
    return [
        m
        if len(m.content) <= limit
        else msgspec.structs.replace(m, content=m.content[:limit] + " [...]")
        for m in messages
    ]


async def next_action(
    llm: RoleLLM,
    messages: ChatMessages,
    schema: dict[str, Any],
    config: ExplorerConfig,
    failed_calls: set[str],
    tried: Set[str] = frozenset(),
) -> ToolCall | Rejection:
    """The model's next call; one that already failed this round is asked for again once,
    warmer (a small model copies its own failed call: three identical failures in a round
    were common), and a second repeat is a ``repeated_call`` rejection, never run. A call
    of ``tried`` (an earlier round's first call) is asked for again once, warmer, and
    then run: where the state offers one valid value (one order to cancel) a variant
    cannot differ, and refusing it left rounds with no step at all."""
    temperature = llm.settings.temperature
    for attempt in range(2):
        outcome = await ask_structured(
            llm,
            messages,
            ToolCall,
            schema=schema,
            max_tokens=config.action_max_tokens,
            temperature=temperature,
        )
        if isinstance(outcome, Rejection):
            return outcome
        key = call_json(outcome)
        if key not in failed_calls and (key not in tried or attempt == 1):
            return outcome
        repeated = outcome.name
        temperature += REPEAT_TEMPERATURE_BOOST
    return Rejection("repeated_call", f"{repeated} failed before in this round")


@dataclass(frozen=True)
class ExplorationSetup:
    """What every round of one exploration shares: the acting model, a maker of fresh
    environments, the task whose initial state each round starts from, the goal, the
    settings and the counter of rejected actions.

    With ``first_functions`` (the functions the policy got wrong), each round's first call
    is one of them, with other values than the calls of ``avoid`` (the calls the parent
    turn expected: a variant of the parent, not the parent again) where the state holds
    others."""

    llm: RoleLLM
    make_env: Callable[[], Environment]
    task: Task
    goal: str
    config: ExplorerConfig
    counter: RejectionCounter
    first_functions: Sequence[str] = ()
    avoid: Sequence[ToolCall] = ()


async def explore_round(
    setup: ExplorationSetup, stats: ExplorationStats, tried: Sequence[ToolCall] = ()
) -> ExplorationRound:
    """One round of at most ``config.max_steps`` actions from the task's initial state.

    With ``first_functions``, the round's first call (the first step that makes one) is
    constrained to those of them the environment offers, so every round tries one of
    them; later steps may call any function (a lookup, a call that uses what the first
    returned). ``tried``: earlier rounds' first calls, which this round's first call should
    not repeat when they take arguments: where the state holds other values for one of
    their parameters, the schema offers only those (``variants.py``), other than those of
    ``avoid`` too."""
    config, first_functions = setup.config, setup.first_functions
    environment = setup.make_env()
    schemas = _SchemaCache()
    try:
        history: list[ChatMessage] = list(
            await anyio.to_thread.run_sync(environment.reset, setup.task)
        )
        steps: list[InteractionStep] = []
        shown: list[tuple[str, str]] = []
        failed_calls: set[str] = set()
        for _ in range(config.max_steps):
            tools = environment.tools()
            if not tools:
                break
            first = not steps
            offered = tools
            if first and first_functions:
                wanted = set(first_functions)
                offered = [t for t in tools if t.get("function", t).get("name") in wanted] or tools
            earlier = [call_json(call) for call in tried if call.arguments] if first else []
            schema = schemas.get(offered)
            avoided = [*setup.avoid, *tried] if first else []
            if first_functions and any(call.arguments for call in avoided):
                varied = varied_tools(offered, avoided, state_of(environment))
                if varied != offered:
                    schema = function_call_schema(varied)
            messages = exploration_messages(
                tools, setup.goal, shown, failed=sorted(failed_calls), tried=earlier
            )
            outcome = await next_action(
                setup.llm, messages, schema, config, failed_calls, set(earlier)
            )
            setup.counter.record(outcome)
            if isinstance(outcome, Rejection):
                stats.rejections.append(outcome)
                log.info("explorer action rejected (%s): %s", outcome.kind, outcome.reason)
                continue
            call = outcome
            text = format_tool_call(call)
            result = await anyio.to_thread.run_sync(environment.step, text)
            tool_messages = [m for m in result.observations if m.role == "tool"]
            observation = "\n".join(m.content for m in tool_messages) or "(no result)"
            failed = bool(result.info.get("errors"))
            stats.failed_calls += int(failed)
            steps.append(
                InteractionStep(
                    history=clipped(history[-config.history_messages :], HISTORY_CHARS),
                    action=call,
                    observation=observation,
                    ok=not failed,
                )
            )
            stats.steps += 1
            history = [
                *history,
                ChatMessage(role="assistant", content=text, tool_calls=[call]),
                *tool_messages,
            ]
            shown.append((call_json(call), observation))
            if failed:
                failed_calls.add(call_json(call))
            if result.done:
                break
        return ExplorationRound(steps=steps)
    finally:
        environment.close()


async def explore(
    setup: ExplorationSetup, rounds: int | None = None
) -> tuple[list[ExplorationRound], ExplorationStats]:
    """``rounds`` (default ``config.rounds``) rounds, each in a fresh environment; with
    ``first_functions``, each first calls one of them, with other values than the rounds
    before it and than the calls of ``avoid`` where the state holds others."""
    stats = ExplorationStats()
    done: list[ExplorationRound] = []
    for _ in range(setup.config.rounds if rounds is None else rounds):
        tried = [r.steps[0].action for r in done if r.steps] if setup.first_functions else []
        done.append(await explore_round(setup, stats, tried))
    return done, stats
