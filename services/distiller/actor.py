"""distiller: rollout groups in (a core subscription: it reads every group without holding
any), experiences out.

Optional (``services.distiller.enabled``). A group whose plain attempts differ enough in
reward waits in a small queue (a new one pushes out the oldest); one at a time, the
distiller asks pool-store for the group's task and the distiller role for the advice
the better attempt holds, and publishes it as an ``Experience`` for pool-store to keep.
Advice it does not keep (not advice, cut off, naming a function or argument the task's
environment lacks) is counted by reason: the ``llm_rejections`` metric (role distiller),
a log line, and the ``coevolve.outcome`` attribute of its ``distiller distil`` span,
which ``coevolve report`` counts.
A group missed while the service is down is not distilled: experiences are an extra.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable

import anyio

from coevolve.services.distiller.config import (
    DISTIL_SPAN,
    KEPT,
    OUTCOME_ATTRIBUTE,
    DistillerConfig,
)
from coevolve.services.distiller.handler import contrast, distil
from coevolve.shared.config import Settings
from coevolve.shared.llm.client import LLMUnavailable
from coevolve.shared.llm.role_actor import RoleActor
from coevolve.shared.llm.roles import RoleClients
from coevolve.shared.messages import Experience, RolloutGroup
from coevolve.shared.pool_client import PoolClient, PoolError
from coevolve.shared.runtime.actor import Actor
from coevolve.shared.runtime.subjects import EXPERIENCES, ROLLOUT_GROUPS
from coevolve.shared.structured import Rejection, RejectionCounter, report_rejection

log = logging.getLogger(__name__)


class DistillerActor(RoleActor):
    name = "distiller"
    roles = ("distiller",)

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings, llm)
        self.config = settings.section(self.name, DistillerConfig)
        self.queue: deque[RolloutGroup] = deque(maxlen=self.config.queue_size)
        self.per_task: Counter[str] = Counter()
        self.rejections = RejectionCounter()
        self.published = 0
        self.dropped = 0
        self.distil_s = 0.0
        self._wake: anyio.Event | None = None
        self._pool: PoolClient | None = None

    async def setup(self) -> None:
        self._wake = anyio.Event()
        self._pool = PoolClient(self.bus)

    def loops(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        return (self.follow_groups, self.distil_queued)

    async def follow_groups(self) -> None:
        await self.bus.follow(ROLLOUT_GROUPS, RolloutGroup, self.offer)

    def offer(self, group: RolloutGroup) -> None:
        """Queue ``group`` when it can teach something new (the target's groups only)."""
        if group.agent != "target" or self.per_task[group.task_id] >= self.config.max_per_task:
            return
        if contrast(group, self.config) is None:
            return
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self.queue.append(group)
        if self._wake is not None:
            self._wake.set()

    async def distil_queued(self) -> None:
        while True:
            if not self.queue:
                assert self._wake is not None
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            group = self.queue.pop()  # the newest: the current policy's mistakes
            self.report_progress("distilling", detail=f"group {group.id[:8]}")
            try:
                await self.distil_one(group)
            finally:
                self.clear_progress()

    async def distil_one(self, group: RolloutGroup) -> None:
        assert self._pool is not None
        try:
            with anyio.fail_after(10):
                task = await self._pool.get(group.task_id)
        except (TimeoutError, PoolError) as exc:
            log.warning("group %s: cannot get task %s: %r", group.id, group.task_id, exc)
            return
        if task is None:
            return
        started = time.perf_counter()
        outcome: Experience | Rejection | None
        try:
            # the span's seconds are the distiller's role-LLM cost in the run report
            with (
                self.tracer.start_as_current_span(DISTIL_SPAN) as span,
                anyio.fail_after(self.config.timeout_s),
            ):
                outcome = await distil(group, task, self.llm["distiller"], self.config)
                if outcome is not None:
                    span.set_attribute(OUTCOME_ATTRIBUTE, outcome_name(outcome))
        except TimeoutError:
            outcome = Rejection("timed_out", f"over {self.config.timeout_s} s")
        except LLMUnavailable as exc:
            outcome = Rejection("unavailable", str(exc))
        self.distil_s += time.perf_counter() - started
        await self.metric("distil_s", self.distil_s)
        await self.metric("groups_dropped", float(self.dropped))
        if outcome is None:
            return
        self.rejections.record(outcome)
        if isinstance(outcome, Rejection):
            about = f"group {group.id}"
            await report_rejection(self.metric, "distiller", self.rejections, outcome, about)
            return
        await self.publish(EXPERIENCES, outcome)
        self.per_task[group.task_id] += 1
        self.published += 1
        await self.metric("experiences", float(self.published))
        log.info("experience from group %s (task %s): %s", group.id, task.id, outcome.text)


def outcome_name(outcome: Experience | Rejection) -> str:
    """``kept``, or the kind of rejection that dropped the advice."""
    return outcome.kind if isinstance(outcome, Rejection) else KEPT


def build(settings: Settings) -> Actor:
    return DistillerActor(settings)
