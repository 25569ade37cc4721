"""The explorer's work without the bus: a signal (or an exploration request) in, the
exploration to publish out.

The explorer service publishes what :func:`explore_signal` and :func:`explore_request`
return; the lockstep schedule hands it to the abstractor's handler itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from opentelemetry.trace import NoOpTracer, Tracer

from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.exploration import ExplorationStats, explore
from coevolve.services.explorer.prompts import (
    CONTEXT_SCHEMA,
    GOAL_TEMPLATES,
    describe_signal,
    exploration_goal,
    render_task,
    summarizer_messages,
    unguided_goal,
)
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.llm import RoleLLM
from coevolve.shared.messages import (
    Exploration,
    ExplorationContext,
    ExplorationMode,
    ExplorationRequest,
    ExplorationRound,
    Signal,
    Task,
    derived_id,
)
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured

log = logging.getLogger(__name__)

# explored: an exploration to publish; empty: no usable action; dropped_without_context:
# the summary was unusable and ``on_context_rejection`` is ``drop``
ExploreOutcome = Literal["explored", "empty", "dropped_without_context"]


@dataclass
class ExplorerDeps:
    """What exploring needs besides the message."""

    summarizer: RoleLLM
    explorer: RoleLLM
    config: ExplorerConfig
    summaries: RejectionCounter  # unusable summaries, by kind
    actions: RejectionCounter  # unusable actions, by kind
    tracer: Tracer = field(default_factory=NoOpTracer)


@dataclass(frozen=True)
class Explored:
    exploration: Exploration | None  # None: nothing to publish (see ``outcome``)
    outcome: ExploreOutcome
    stats: ExplorationStats
    summary_rejection: Rejection | None = None  # the summarizer's unusable output


async def explore_signal(signal: Signal, deps: ExplorerDeps) -> Explored:
    """The summarizer's context for ``signal``, then ``rounds`` guided rounds from its task.

    Without a usable summary the signal's own description steers the rounds (or, with
    ``on_context_rejection: drop``, nothing is explored). Raises only ``LLMUnavailable``.
    """
    with deps.tracer.start_as_current_span(
        "explorer summarize", attributes={"coevolve.detail": signal.kind}
    ):
        summary = await summarize_signal(
            deps.summarizer, signal, deps.config.summary_max_tokens, deps.summaries
        )
    if isinstance(summary, Rejection):
        if deps.config.on_context_rejection == "drop":
            return Explored(None, "dropped_without_context", ExplorationStats(), summary)
        context, rejection = None, summary
    else:
        context, rejection = summary, None
    explored = await explore_task(
        deps,
        exploration_id=derived_id("exploration", signal.id),
        mode="guided",
        task=signal.task,
        goal=guided_goal(signal, context),
        rounds=deps.config.rounds,
        context=context,
        signal=signal,
    )
    return Explored(explored.exploration, explored.outcome, explored.stats, rejection)


async def explore_request(request: ExplorationRequest, deps: ExplorerDeps) -> Explored:
    """Unguided rounds (``request.rounds``, capped at ``max_request_rounds``) from the
    request's task. Raises only ``LLMUnavailable``."""
    return await explore_task(
        deps,
        exploration_id=derived_id("exploration", request.id),
        mode="unguided",
        task=request.task,
        goal=unguided_goal(request.task),
        rounds=max(1, min(request.rounds, deps.config.max_request_rounds)),
        context=None,
        signal=None,
    )


async def explore_task(
    deps: ExplorerDeps,
    *,
    exploration_id: str,
    mode: ExplorationMode,
    task: Task,
    goal: str,
    rounds: int,
    context: ExplorationContext | None,
    signal: Signal | None,
) -> Explored:
    """``rounds`` rounds towards ``goal``, each in a fresh environment in the task's state."""
    environment = task.environment

    def make_env() -> Environment:
        return make_environment(environment)

    with deps.tracer.start_as_current_span(
        "explorer explore", attributes={"coevolve.detail": mode}
    ):
        done, stats = await explore(
            deps.explorer, make_env, task, goal, deps.config, deps.actions, rounds
        )
    if stats.steps == 0:
        log.warning("exploration %s: no usable action in %d rounds", exploration_id, rounds)
        return Explored(None, "empty", stats)
    exploration = exploration_message(
        exploration_id, mode, task, done, context=context, signal=signal
    )
    return Explored(exploration, "explored", stats)


async def summarize_signal(
    llm: RoleLLM, signal: Signal, max_tokens: int, counter: RejectionCounter
) -> ExplorationContext | Rejection:
    """The summarizer role's :class:`ExplorationContext` for ``signal``, or why it is
    unusable (counted in ``counter``). Raises only ``LLMUnavailable``."""
    return await ask_structured(
        llm,
        summarizer_messages(signal),
        ExplorationContext,
        schema=CONTEXT_SCHEMA,
        max_tokens=max_tokens,
        temperature=llm.settings.temperature,
        counter=counter,
    )


def guided_goal(signal: Signal, context: ExplorationContext | None) -> str:
    """The exploration goal for ``signal``: its kind's goal with the summarized context, or
    with the signal's own description when there is no usable summary."""
    if context is not None:
        return exploration_goal(signal.kind, context, signal.task)
    return signal_goal(signal)


def exploration_message(
    exploration_id: str,
    mode: ExplorationMode,
    task: Task,
    rounds: list[ExplorationRound],
    *,
    context: ExplorationContext | None,
    signal: Signal | None,
) -> Exploration:
    """The exploration as published: its rounds plus the signal (if any) that steered it."""
    return Exploration(
        id=exploration_id,
        mode=mode,
        task=task,
        rounds=rounds,
        context=context,
        signal_id=signal.id if signal else None,
        signal_kind=signal.kind if signal else None,
        signal_evidence=dict(signal.evidence) if signal else {},
    )


def signal_goal(signal: Signal) -> str:
    """The signal kind's goal when no summary is available: the signal's own words (its
    kind and evidence) stand in for the context."""
    goal = GOAL_TEMPLATES[signal.kind].format(context=describe_signal(signal.kind, signal.evidence))
    return (
        f"{goal}\n\nThe environment starts in the state of this task:\n{render_task(signal.task)}"
    )
