"""signal-monitor: rollout groups in, signals out (``coevolve.signals.<kind>``).

Each group is judged against what the monitor remembers (score windows, action-pattern
counts, entropies; see ``detectors.py``). The task a group belongs to comes from
pool-store (cached). Order per group: detect, publish every signal (``Nats-Msg-Id`` = the
signal id, derived from the group id and kind), save the state, then return so the group
is acked. A crash anywhere before the save reprocesses the group from the saved state and
republishes the same signal ids, which the bus drops as duplicates.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import anyio

from coevolve.services.signal_monitor.config import SignalMonitorConfig
from coevolve.services.signal_monitor.handler import SignalMonitor, TaskCache
from coevolve.services.signal_monitor.state import StateStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import RolloutGroup, Task
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery, Rejected
from coevolve.shared.runtime.subjects import MONITOR_GROUPS_CONSUMER, signal_subject

log = logging.getLogger(__name__)


class SignalMonitorActor(Actor):
    name = "signal_monitor"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, SignalMonitorConfig)
        self.store = StateStore(settings.run_dir / self.config.state_file)
        self.monitor = SignalMonitor(self.config.detectors)
        self.tasks = TaskCache(self.config.task_cache_size)
        self.published: defaultdict[str, int] = defaultdict(int)
        self.skipped: defaultdict[str, int] = defaultdict(int)
        self._pool: PoolClient | None = None

    async def setup(self) -> None:
        state = await anyio.to_thread.run_sync(self.store.load)
        self.monitor = SignalMonitor(self.config.detectors, state)
        self._pool = PoolClient(self.bus)
        log.info(
            "signal state from %s: %d groups seen, %d tasks with score windows",
            self.store.path,
            state.groups_processed,
            len(state.score_windows),
        )

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (Consumer(MONITOR_GROUPS_CONSUMER, RolloutGroup, self.on_group),)

    async def task_of(self, task_id: str) -> Task | None:
        task = self.tasks.get(task_id)
        if task is None:
            assert self._pool is not None
            task = await self._pool.get(task_id)  # no pool-store: raises, the group is retried
            if task is not None:
                self.tasks.put(task)
        return task

    async def on_group(self, group: RolloutGroup, _: Delivery) -> None:
        if group.agent != "target" or self.monitor.seen(group.id):
            return  # the failure agent's failures say nothing of the target's
        task = await self.task_of(group.task_id)
        if task is None:
            # A group of a task pool-store does not know (deleted run dir, foreign
            # publisher): nothing to explore from. Counted and dead-lettered, not retried.
            self.skipped["unknown_task"] += 1
            await self.metric("groups_skipped", self.skipped["unknown_task"], reason="unknown_task")
            raise Rejected(f"group {group.id}: task {group.task_id} is not in the pool")
        try:
            signals = self.monitor.process(group, task)
            for signal in signals:
                await self.publish(signal_subject(signal.kind), signal)
            await anyio.to_thread.run_sync(self.store.save, self.monitor.state)
        except BaseException:
            # The in-memory state already counts this group as seen; go back to the saved
            # state so the redelivered group is processed again, not skipped.
            with anyio.CancelScope(shield=True):
                state = await anyio.to_thread.run_sync(self.store.load)
            self.monitor = SignalMonitor(self.config.detectors, state)
            raise
        for signal in signals:
            self.published[signal.kind] += 1
            log.info(
                "signal %s %s for task %s (group %s)", signal.kind, signal.id, task.id, group.id
            )
            await self.metric("signals", self.published[signal.kind], kind=signal.kind)


def build(settings: Settings) -> Actor:
    return SignalMonitorActor(settings)
