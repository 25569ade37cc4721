"""explorer: signals (and unguided exploration requests) in, explorations out.

Per signal: the summarizer role writes the :class:`ExplorationContext` for the signal's
kind; then ``rounds`` rounds of ``max_steps`` actions explore a fresh environment started
from the task's state (see ``exploration.py``). The exploration, published on
``coevolve.explorations``, carries the context, the rounds and the signal's id, kind and
evidence; its id derives from the signal (or request) id, so a redelivery republishes the
same id and the bus drops the copy.

An unusable summary (malformed, cut off, wrong fields) is a counted rejection; by default
(``on_context_rejection: explore``) the exploration still runs, steered by the signal's own
description instead of a summary, and carries no context. ``drop`` acks the signal without
exploring. An exploration in which no action was usable is not published (counted as
``empty``). An unreachable LLM raises, so the runtime hands the signal back for later.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from opentelemetry.trace import Tracer

from coevolve.services.explorer.exploration import ExplorationLimits, ExplorationStats, explore
from coevolve.services.explorer.prompts import (
    CONTEXT_SCHEMA,
    GOAL_TEMPLATES,
    describe_signal,
    exploration_goal,
    render_task,
    summarizer_messages,
    unguided_goal,
)
from coevolve.shared.actor import Actor, Consumer, Delivery
from coevolve.shared.config import Settings
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.llm import RoleClients, RoleLLM
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
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured, report_rejection
from coevolve.shared.subjects import (
    EXPLORATIONS,
    EXPLORER_REQUESTS_CONSUMER,
    EXPLORER_SIGNALS_CONSUMER,
)

log = logging.getLogger(__name__)

RECENT_IDS = 10_000


class ExplorerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    rounds: int = 1
    max_steps: int = 3
    max_request_rounds: int = 8
    summary_max_tokens: int = 400
    action_max_tokens: int = 96
    on_context_rejection: Literal["explore", "drop"] = "explore"
    history_messages: int = 12
    concurrency: int = 1


class ExplorerActor(Actor):
    name = "explorer"

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, ExplorerConfig)
        self._own_llm = llm is None
        self.llm = llm or RoleClients.from_section(
            settings.services.get("llm"), settings.run_dir, roles=("summarizer", "explorer")
        )
        self.limits = exploration_limits(self.config)
        self.summaries = RejectionCounter()
        self.actions = RejectionCounter()
        self.outcomes: Counter[str] = Counter()
        # ids of recent explorations published (bounded: the service runs for days)
        self.handled: deque[str] = deque(maxlen=RECENT_IDS)

    async def teardown(self) -> None:
        if self._own_llm:
            await self.llm.aclose()

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (
            Consumer(EXPLORER_SIGNALS_CONSUMER, Signal, self.on_signal, self.config.concurrency),
            Consumer(
                EXPLORER_REQUESTS_CONSUMER,
                ExplorationRequest,
                self.on_request,
                self.config.concurrency,
            ),
        )

    # ------------------------------------------------------------------ handlers

    async def on_signal(self, signal: Signal, _: Delivery) -> None:
        context = await self.summarize(signal)
        if context is None and self.config.on_context_rejection == "drop":
            await self._count("dropped_without_context")
            return
        await self._explore_and_publish(
            exploration_id=derived_id("exploration", signal.id),
            mode="guided",
            task=signal.task,
            goal=guided_goal(signal, context),
            rounds=self.config.rounds,
            context=context,
            signal=signal,
        )

    async def on_request(self, request: ExplorationRequest, _: Delivery) -> None:
        await self._explore_and_publish(
            exploration_id=derived_id("exploration", request.id),
            mode="unguided",
            task=request.task,
            goal=unguided_goal(request.task),
            rounds=max(1, min(request.rounds, self.config.max_request_rounds)),
            context=None,
            signal=None,
        )

    # ------------------------------------------------------------------ steps

    async def summarize(self, signal: Signal) -> ExplorationContext | None:
        """The summarizer's context for ``signal``; None (counted) when unusable."""
        with self._span("explorer summarize", signal.kind):
            outcome = await summarize_signal(
                self.llm["summarizer"], signal, self.config.summary_max_tokens, self.summaries
            )
        if isinstance(outcome, Rejection):
            about = f"signal {signal.id}"
            await report_rejection(self.metric, "summarizer", self.summaries, outcome, about)
            return None
        return outcome

    async def _explore_and_publish(
        self,
        *,
        exploration_id: str,
        mode: ExplorationMode,
        task: Task,
        goal: str,
        rounds: int,
        context: ExplorationContext | None,
        signal: Signal | None,
    ) -> None:
        environment = task.environment

        def make_env() -> Environment:
            return make_environment(environment)

        with self._span("explorer explore", mode):
            explored, stats = await explore(
                self.llm["explorer"], make_env, task, goal, self.limits, self.actions, rounds
            )
        await self._report_rejections(stats)
        if stats.steps == 0:
            log.warning("exploration %s: no usable action in %d rounds", exploration_id, rounds)
            await self._count("empty")
            return
        exploration = exploration_message(
            exploration_id, mode, task, explored, context=context, signal=signal
        )
        await self.publish(EXPLORATIONS, exploration)
        self.handled.append(exploration_id)
        log.info(
            "exploration %s (%s, task %s): %d steps, %d failed calls",
            exploration_id,
            mode,
            task.id,
            stats.steps,
            stats.failed_calls,
        )
        await self._count("published")
        await self.metric("exploration_steps", stats.steps, mode=mode)

    async def _report_rejections(self, stats: ExplorationStats) -> None:
        for kind in sorted({r.kind for r in stats.rejections}):
            await self.metric(
                "llm_rejections", self.actions.rejected[kind], role="explorer", kind=kind
            )

    async def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        await self.metric("explorations", self.outcomes[outcome], outcome=outcome)

    def _span(self, name: str, detail: str) -> Any:
        tracer: Tracer = self.tracer
        return tracer.start_as_current_span(name, attributes={"coevolve.detail": detail})


def exploration_limits(config: ExplorerConfig) -> ExplorationLimits:
    return ExplorationLimits(
        rounds=config.rounds,
        max_steps=config.max_steps,
        action_max_tokens=config.action_max_tokens,
        history_messages=config.history_messages,
    )


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


def build(settings: Settings) -> Actor:
    return ExplorerActor(settings)
