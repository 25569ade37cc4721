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

With ``labels: none`` and a D0 that ``up`` built only the first tasks of, an explorer idle
for ``discover_when_idle_s`` sends itself the unguided exploration of the environment's
next start state (``discovery.py``), so discovery goes on beside training until the pool
holds D0's ``d0.tasks`` discovered tasks. A whole D0 (committed or given) gets none: the
explorer stays on the signals.

The work is ``handler.explore_signal`` / ``handler.explore_request`` (no bus); this actor
publishes what they return and reports the counts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import anyio
import msgspec

from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.discovery import (
    calls_of,
    d0_to_complete,
    discovery_request,
    start_order,
    world_starts,
)
from coevolve.services.explorer.handler import (
    Explored,
    ExplorerDeps,
    explore_request,
    explore_signal,
)
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients
from coevolve.shared.llm.role_actor import RoleActor
from coevolve.shared.messages import Exploration, ExplorationRequest, Signal, Task
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery
from coevolve.shared.runtime.subjects import (
    EXPLORATION_REQUESTS,
    EXPLORATIONS,
    EXPLORER_REQUESTS_CONSUMER,
    EXPLORER_SIGNALS_CONSUMER,
)
from coevolve.shared.structured import RejectionCounter, report_rejection

log = logging.getLogger(__name__)
# candidates asked of the pool for sibling parents, before the cooldown filter
SIBLINGS_ASKED = 50
# discovered tasks whose calls an unguided exploration beside training is told of
COVERED_ASKED = 50


class ExplorerActor(RoleActor):
    name = "explorer"
    roles = ("summarizer", "explorer")

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings, llm)
        self.config = settings.section(self.name, ExplorerConfig)
        self.summaries = RejectionCounter()
        self.actions = RejectionCounter()
        self.outcomes: Counter[str] = Counter()
        self.varied_at: dict[str, int] = {}  # parent_cooldown_versions
        self.busy = 0
        self.idle_since = time.monotonic()

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

    def loops(self) -> Sequence[Callable[[], Awaitable[None]]]:
        if self.settings.labels == "none" and self.config.discover_when_idle_s > 0:
            return (self._discover_when_idle,)
        return ()

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.idle_since = time.monotonic()

    async def _discover_when_idle(self) -> None:
        """Send the next start state's unguided exploration whenever nothing kept this
        explorer busy for ``discover_when_idle_s``."""
        idle_s = self.config.discover_when_idle_s
        target = await anyio.to_thread.run_sync(d0_to_complete, self.settings)
        if not target:
            log.info("discovery beside training: off, the run's D0 is a whole set")
            return
        starts, _ = await anyio.to_thread.run_sync(world_starts, self.settings)
        if not starts:
            log.warning("discovery beside training: no start state in this world")
            return
        order = itertools.cycle(start_order(starts, len(starts), self.settings.d0.seed))
        for sent in itertools.count():
            while self.busy or time.monotonic() - self.idle_since < idle_s:
                await anyio.sleep(min(5.0, idle_s))
            pool = PoolClient(self.bus)
            try:
                discovered = await pool.sample(COVERED_ASKED, mix={"explored": 1.0})
                ready = (await pool.stats()).tasks_by_origin.get("explored", 0)
            except Exception as exc:  # pool-store away: try again after the idle time
                log.warning("discovery beside training: no pool: %r", exc)
                self.idle_since = time.monotonic()
                continue
            if ready >= target:
                self.report_progress("D0 complete beside training", ready, total=target)
                log.info("discovery beside training: done, %d discovered tasks", ready)
                return
            start = next(order)
            covered = [calls_of(task) for task in discovered]
            request = discovery_request(self.settings, f"idle-{os.getpid()}-{sent}", start, covered)
            await self.publish(EXPLORATION_REQUESTS, request)
            detail = f"start state {start.id}; {ready} of D0's {target} discovered tasks ready"
            self.report_progress("discovering beside training", sent + 1, detail=detail)
            log.info("discovery beside training: exploring %s", detail)
            self.idle_since = time.monotonic()

    @property
    def deps(self) -> ExplorerDeps:
        return ExplorerDeps(
            summarizer=self.llm["summarizer"],
            explorer=self.llm["explorer"],
            config=self.config,
            summaries=self.summaries,
            actions=self.actions,
            tracer=self.tracer,
            labelled=self.settings.labels != "none",
            atoms=self._atoms_for,
            siblings=self._tasks_calling,
            varied_at=self.varied_at,
        )

    async def _atoms_for(self, task: Task) -> list[Task]:
        """The pool's tasks that start where ``task`` starts (none when pool-store is
        away: composition then joins nothing)."""
        return await self._pool_tasks("atoms", task, PoolClient(self.bus).atoms_for(task.id))

    async def _tasks_calling(self, task: Task, functions: list[str]) -> list[Task]:
        """The pool's unsynthesized tasks besides ``task`` that call one of ``functions``
        (none when pool-store is away: the signal's own turn is varied alone)."""
        client = PoolClient(self.bus)
        asked = client.tasks_calling(
            functions, task.environment, exclude=[task.id], limit=SIBLINGS_ASKED
        )
        return await self._pool_tasks("sibling parents", task, asked)

    @staticmethod
    async def _pool_tasks(what: str, task: Task, asked: Awaitable[list[Task]]) -> list[Task]:
        """What pool-store answered, or [] with a warning when it did not."""
        try:
            return await asked
        except Exception as exc:
            log.warning("no %s for task %s: %r", what, task.id, exc)
            return []

    async def on_signal(self, signal: Signal, _: Delivery) -> None:
        self.clear_progress()  # no longer discovering
        with self._working():
            explored = await explore_signal(signal, self.deps)
        if explored.summary_rejection is not None:
            about = f"signal {signal.id}"
            rejection = explored.summary_rejection
            await report_rejection(self.metric, "summarizer", self.summaries, rejection, about)
        await self._publish(explored)

    async def on_request(self, request: ExplorationRequest, _: Delivery) -> None:
        with self._working():
            await self._publish(await explore_request(request, self.deps))

    async def _publish(self, explored: Explored) -> None:
        """Publish the exploration (if there is one); count and report what happened."""
        for kind in sorted({r.kind for r in explored.stats.rejections}):
            await self.metric(
                "llm_rejections", self.actions.rejected[kind], role="explorer", kind=kind
            )
        explorations = explored.explorations
        if not explorations:
            await self._count(explored.outcome)
            return
        for exploration in explorations:
            await self.publish(EXPLORATIONS, exploration)
            if self.config.record:
                await anyio.to_thread.run_sync(self._record, exploration)
            log.info(
                "exploration %s (%s, task %s): %d rounds",
                exploration.id,
                exploration.mode,
                exploration.task.id,
                len(exploration.rounds),
            )
        stats = explored.stats
        await self._count("published")
        await self.metric("exploration_steps", stats.steps, mode=explorations[0].mode)

    def _record(self, exploration: Exploration) -> None:
        record = self.settings.path(f"{self.config.record}-{os.getpid()}.jsonl")
        with record.open("ab") as file:
            file.write(msgspec.json.encode(exploration) + b"\n")

    async def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        await self.metric("explorations", self.outcomes[outcome], outcome=outcome)


def build(settings: Settings) -> Actor:
    return ExplorerActor(settings)
