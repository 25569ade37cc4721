"""pool-store: the only writer of the task pool (DuckDB).

Answers request/reply on ``coevolve.pool.rpc`` (add, get, sample, stats, lineage), records
rollout results and verdicts from their streams (acked only after the DuckDB transaction
committed; idempotent by message id), seeds an empty pool from the environments' train
splits, and keeps the rollout job queue topped up from sampled batches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from nats.js.errors import NotFoundError

from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.actor import Actor, Consumer, Delivery, Rejected, Responder
from coevolve.shared.config import ConfigError, Settings
from coevolve.shared.messages import (
    AddTasks,
    AddTasksReply,
    GetStats,
    GetTask,
    GetTaskReply,
    LineageQuery,
    LineageReply,
    Message,
    PoolRequest,
    PoolStats,
    RolloutJob,
    RolloutResults,
    SampleBatch,
    SampleBatchReply,
    Task,
    TaskAdded,
    Verdict,
    derived_id,
)
from coevolve.shared.subjects import (
    POOL_ADD,
    POOL_RESULTS_CONSUMER,
    POOL_RPC,
    POOL_VERDICTS_CONSUMER,
    ROLLOUT_JOBS,
    ROLLOUT_JOBS_CONSUMER,
    TASK_ADDED,
)

log = logging.getLogger(__name__)


def default_seed_grains() -> dict[str, float]:
    # imported when needed: the BFCL task tables load bfcl_eval
    from coevolve.shared.envs.bfcl.tasks import DEFAULT_SEED_GRAINS

    return dict(DEFAULT_SEED_GRAINS)


def default_seed_classes() -> list[str]:
    from coevolve.shared.envs.bfcl.tasks import FOCUS_CLASSES

    return list(FOCUS_CLASSES)


class PoolStoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    db_file: str = "pool.duckdb"
    seed_environments: list[str] = msgspec.field(default_factory=lambda: ["bfcl"])
    # shares of per-turn tasks and whole entries in the seed pool (see seed_tasks_for)
    seed_grains: dict[str, float] = msgspec.field(default_factory=default_seed_grains)
    # the world: seed only BFCL entries whose API classes are all in this list (default: a
    # focused three-class world, see FOCUS_CLASSES); null: every class, the full BFCL world
    seed_classes: list[str] | None = msgspec.field(default_factory=default_seed_classes)
    mix: dict[str, float] = msgspec.field(
        default_factory=lambda: {"seed": 0.5, "explored": 0.25, "synthesized": 0.25}
    )
    feed_jobs: bool = True
    job_queue_depth: int = 4
    group_size: int = 8
    feed_interval_s: float = 1.0
    # which tasks of an origin jobs and sample replies get: sampler (dynamic | uniform),
    # window, unseen_share, uniform_weight, retire_after (see sampling.SamplingConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.seed_classes is not None:
            from coevolve.shared.envs.bfcl.tasks import check_classes

            check_classes(self.seed_classes)


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
        open_store = functools.partial(PoolStore, path, sampling=self.config.sampling)
        self.store = await anyio.to_thread.run_sync(open_store)
        log.info("sampling tasks with the %s sampler", self.config.sampling.sampler)
        stats = await self._db(self.store.stats)
        if sum(stats.tasks_by_origin.values()) == 0:
            for environment in self.config.seed_environments:
                await self._seed(environment)

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

    async def on_verdict(self, verdict: Verdict, _: Delivery) -> None:
        assert self.store is not None
        _, added_task_id = await self._db(self.store.record_verdict, verdict)
        if added_task_id is not None:
            event = TaskAdded(
                id=derived_id("task-added", added_task_id),
                task_id=added_task_id,
                origin=verdict.task.origin,
            )
            await self.publish(TASK_ADDED, event)

    async def on_add(self, request: AddTasks) -> Message:
        store = self.store
        assert store is not None
        added, duplicates = await self._db(store.add_tasks, request.tasks)
        for task in request.tasks:
            if task.id in added:
                event = TaskAdded(
                    id=derived_id("task-added", task.id), task_id=task.id, origin=task.origin
                )
                await self.publish(TASK_ADDED, event)
        return AddTasksReply(added=added, duplicates=duplicates)

    async def on_request(self, request: Message) -> Message:
        store = self.store
        assert store is not None
        match request:
            case AddTasks():
                # pool.rpc is open to read-only users: writes go through pool.add
                raise Rejected(f"tasks are added on {POOL_ADD} (operator credentials)")
            case GetTask(task_id=task_id):
                return GetTaskReply(task=await self._db(store.get_task, task_id))
            case SampleBatch(size=size, mix=mix, environment=environment, seed=seed):
                if size < 1 or size > 10_000:
                    raise Rejected(f"batch size must be in 1..10000, got {size}")
                tasks = await self._db(
                    store.sample_batch, size, mix or self.config.mix, environment, seed
                )
                return SampleBatchReply(tasks=tasks)
            case GetStats():
                stats: PoolStats = await self._db(store.stats)
                return stats
            case LineageQuery(task_id=task_id):
                task = await self._db(store.get_task, task_id)
                chain = await self._db(store.lineage, task_id) if task else {}
                return LineageReply(task=task, chain=chain)
        raise ValueError(f"unsupported request {type(request).__name__}")

    async def feed_rollout_jobs(self) -> None:
        """Keep a few rollout jobs queued; the bounded stream is the backpressure."""
        assert self.store is not None
        stream = ROLLOUT_JOBS_CONSUMER.stream
        round_ = 0
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
            tasks = await self._db(self.store.sample_batch, missing, self.config.mix, None, None)
            for task in tasks:
                round_ += 1
                job = RolloutJob(
                    id=derived_id("job", task.id, info.state.last_seq, round_),
                    task=task,
                    group_size=self.config.group_size,
                )
                await self.publish(ROLLOUT_JOBS, job)


def seed_tasks_for(
    environment: str,
    grains: dict[str, float] | None = None,
    classes: Sequence[str] | None = None,
) -> list[Task]:
    """The train split of an environment, as origin-"seed" tasks (for BFCL: of the entries
    whose API classes are all in ``classes``; None: every entry).

    For BFCL: per-turn tasks (``env_config["grain"] == "turn"``, ids ``<entry>#t<turn>``)
    beside whole entries, in the shares ``grains`` gives (``turns`` / ``entries``, default
    per-turn only; the pool holds them in that proportion, so uniform sampling within the
    seed origin sees them in it).
    """
    if environment == "bfcl":
        from coevolve.shared.envs.bfcl.tasks import check_classes, seed_pool

        if classes is not None:
            try:
                check_classes(classes)
            except ValueError as exc:
                raise ConfigError(f"services.pool_store.seed_classes: {exc}") from exc
        try:
            return seed_pool(grains, classes)
        except ValueError as exc:
            raise ConfigError(f"services.pool_store.seed_grains: {exc}") from exc
    raise ConfigError(f"services.pool_store.seed_environments: no seed tasks for {environment!r}")


def build(settings: Settings) -> Actor:
    return PoolStoreActor(settings)
