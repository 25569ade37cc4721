"""pool-store: the only writer of the task pool (DuckDB).

Answers request/reply on ``coevolve.pool.rpc`` (add, get, sample, stats, lineage), records
rollout results and verdicts from their streams (acked only after the DuckDB transaction
committed; idempotent by message id) and the distiller's experiences, seeds an empty pool
from the environments' train splits, and keeps the rollout job queue topped up from
sampled batches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from nats.js.errors import NotFoundError

from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import (
    RequestRefused,
    add_tasks,
    answer,
    keep_experience,
    labelled_tasks_in,
    record_verdict,
    rollout_jobs,
    seed_tasks_for,
    unlabelled_seed,
)
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import ConfigError, Settings
from coevolve.shared.messages import (
    AddTasks,
    Experience,
    Message,
    PoolRequest,
    RolloutResults,
    Verdict,
)
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery, Rejected, Responder
from coevolve.shared.runtime.subjects import (
    POOL_ADD,
    POOL_EXPERIENCES_CONSUMER,
    POOL_RESULTS_CONSUMER,
    POOL_RPC,
    POOL_VERDICTS_CONSUMER,
    ROLLOUT_JOBS,
    ROLLOUT_JOBS_CONSUMER,
    TASK_ADDED,
)

log = logging.getLogger(__name__)


class PoolStoreActor(Actor):
    name = "pool_store"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, PoolStoreConfig)
        self.store: PoolStore | None = None
        self._lock = anyio.Lock()

    async def _db(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking DuckDB call in a worker thread, one at a time."""
        async with self._lock:
            return await anyio.to_thread.run_sync(fn, *args)

    async def setup(self) -> None:
        path = self.settings.path(self.config.db_file)
        open_store = functools.partial(
            PoolStore,
            path,
            sampling=self.config.sampling,
            fresh_versions=self.settings.pacing.max_versions_to_first_draw,
        )
        self.store = await anyio.to_thread.run_sync(open_store)
        log.info("sampling tasks with the %s sampler", self.config.sampling.sampler)
        stats = await self._db(self.store.stats)
        if self.settings.labels == "none":
            await self._seed_unlabelled(sum(stats.tasks_by_origin.values()) == 0)
        elif sum(stats.tasks_by_origin.values()) == 0:
            for environment in self.config.seed_environments:
                await self._seed(environment)

    async def _seed_unlabelled(self, empty: bool) -> None:
        """A run with no labels: an empty pool starts from D0; a pool that holds labelled
        tasks (a run directory of a labelled run) is refused."""
        assert self.store is not None
        labelled = await self._db(labelled_tasks_in, self.store)
        if labelled:
            raise ConfigError(
                f"labels: none, but the pool in {self.settings.run_dir} holds {labelled} "
                "labelled tasks: start the run in a fresh run directory"
            )
        if not empty:
            return
        path = self.settings.d0.path(self.settings.run_dir)
        tasks = await anyio.to_thread.run_sync(unlabelled_seed, path)
        added, _ = await self._db(self.store.add_tasks, tasks)
        log.info("seeded %d tasks from D0 (%s), no labelled task", len(added), path)

    async def _seed(self, environment: str) -> None:
        assert self.store is not None
        tasks = await anyio.to_thread.run_sync(
            seed_tasks_for, environment, self.config.seed_grains, self.config.seed_classes
        )
        added, _ = await self._db(self.store.add_tasks, tasks)
        log.info("seeded %d %s tasks from the train split", len(added), environment)

    async def teardown(self) -> None:
        if self.store is not None:
            await self._db(self.store.close)

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (
            Consumer(POOL_RESULTS_CONSUMER, RolloutResults, self.on_results, concurrency=4),
            Consumer(POOL_VERDICTS_CONSUMER, Verdict, self.on_verdict, concurrency=4),
            Consumer(POOL_EXPERIENCES_CONSUMER, Experience, self.on_experience),
        )

    def responders(self) -> Sequence[Responder]:
        return (
            Responder(POOL_RPC, PoolRequest, self.on_request),
            Responder(POOL_ADD, AddTasks, self.on_add),
        )

    def loops(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return (self.feed_rollout_jobs,) if self.config.feed_jobs else ()

    async def on_results(self, results: RolloutResults, _: Delivery) -> None:
        assert self.store is not None
        await self._db(self.store.record_results, results)

    async def on_experience(self, experience: Experience, _: Delivery) -> None:
        if await self._db(keep_experience, self.store, experience):
            log.info("kept experience %s of task %s", experience.id, experience.task_id)

    async def on_verdict(self, verdict: Verdict, _: Delivery) -> None:
        event = await self._db(record_verdict, self.store, verdict)
        if event is not None:
            await self.publish(TASK_ADDED, event)

    async def on_add(self, request: AddTasks) -> Message:
        reply, events = await self._db(add_tasks, self.store, request)
        for event in events:
            await self.publish(TASK_ADDED, event)
        return reply

    async def on_request(self, request: Message) -> Message:
        try:
            reply: Message = await self._db(answer, self.store, request, self.config)
        except RequestRefused as exc:
            raise Rejected(str(exc)) from exc
        return reply

    async def feed_rollout_jobs(self) -> None:
        """Keep a few rollout jobs queued; the bounded stream is the backpressure."""
        stream = ROLLOUT_JOBS_CONSUMER.stream
        queued = 0
        while True:
            await anyio.sleep(self.config.feed_interval_s)
            try:
                with anyio.fail_after(5):
                    info = await self.bus.js.stream_info(stream)
            except (TimeoutError, NotFoundError) as exc:
                log.warning("cannot read %s depth: %r", stream, exc)
                continue
            missing = self.config.job_queue_depth - int(info.state.messages)
            if missing <= 0:
                continue
            jobs = await self._db(
                rollout_jobs, self.store, missing, self.config, info.state.last_seq, queued
            )
            queued += len(jobs)
            for job in jobs:
                await self.publish(ROLLOUT_JOBS, job)


def build(settings: Settings) -> Actor:
    return PoolStoreActor(settings)
