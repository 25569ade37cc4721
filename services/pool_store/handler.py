"""Pool-store's work without the bus: requests, verdicts, results and experiences against
the store (DuckDB, ``store.py``), the seed tasks of an empty pool and the rollout jobs to
queue (each with the kept experiences most like its task).

Every function here runs in one worker thread at a time (the store is not thread-safe)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import msgspec

from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import ConfigError
from coevolve.shared.envs.bfcl.tasks import config_without_conversation
from coevolve.shared.experience import rank_experiences
from coevolve.shared.messages import (
    AddTasks,
    AddTasksReply,
    AtomsFor,
    Experience,
    ExperiencesReply,
    GetStats,
    GetTask,
    GetTaskReply,
    LineageQuery,
    LineageReply,
    ListExperiences,
    Message,
    Origin,
    RolloutJob,
    SampleBatch,
    SampleBatchReply,
    Task,
    TaskAdded,
    TasksCalling,
    Verdict,
    derived_id,
)
from coevolve.shared.runtime.subjects import POOL_ADD
from coevolve.shared.task_sets import D0Error, load_d0

log = logging.getLogger(__name__)

MAX_BATCH = 10_000


class RequestRefused(ValueError):
    """A request pool-store will not carry out; the reason goes back to the caller."""


def answer(store: PoolStore, request: Message, config: PoolStoreConfig) -> Message:
    """The reply to one ``coevolve.pool.rpc`` request (reads only)."""
    match request:
        case AddTasks():
            # pool.rpc is open to read-only users: writes go through pool.add
            raise RequestRefused(f"tasks are added on {POOL_ADD} (operator credentials)")
        case GetTask(task_id=task_id):
            return GetTaskReply(task=store.get_task(task_id))
        case SampleBatch(size=size, mix=mix, environment=environment, seed=seed):
            if size < 1 or size > MAX_BATCH:
                raise RequestRefused(f"batch size must be in 1..{MAX_BATCH}, got {size}")
            return SampleBatchReply(
                tasks=store.sample_batch(size, mix or config.mix, environment, seed)
            )
        case AtomsFor(task_id=task_id, limit=limit):
            return SampleBatchReply(tasks=atoms_for(store, task_id, limit))
        case TasksCalling():
            return SampleBatchReply(tasks=tasks_calling(store, request))
        case GetStats():
            return store.stats()
        case LineageQuery(task_id=task_id):
            task = store.get_task(task_id)
            return LineageReply(task=task, chain=store.lineage(task_id) if task else {})
        case ListExperiences(limit=limit):
            return experiences_reply(store, limit)
    raise ValueError(f"unsupported request {type(request).__name__}")


# tasks scanned for atoms: the newest, enough for a run's pool
ATOM_SCAN_LIMIT = 2000


def atoms_for(store: PoolStore, task_id: str, limit: int) -> list[Task]:
    """Active one-turn tasks, newest first, with no conversation before their turn, in
    ``task_id``'s environment and setting: what composition may join with it ([] when
    the task is unknown)."""
    task = store.get_task(task_id)
    if task is None:
        return []
    setting = config_without_conversation(task.env_config)
    found = [
        other
        for other in store.list_tasks(limit=ATOM_SCAN_LIMIT, environment=task.environment)
        if other.id != task.id
        and other.status == "active"
        and len(other.user_turns) == 1
        and not other.env_config.get("prior_turns")
        and config_without_conversation(other.env_config) == setting
    ]
    return found[:limit]


def tasks_calling(store: PoolStore, request: TasksCalling) -> list[Task]:
    """Active tasks of synthesis depth 0 in the request's environment, newest first,
    whose calls include one of its functions, none of its excluded ids."""
    wanted, excluded = set(request.functions), set(request.exclude)
    found = [
        task
        for task in store.list_tasks(limit=ATOM_SCAN_LIMIT, environment=request.environment)
        if task.status == "active"
        and task.lineage.depth == 0
        and task.id not in excluded
        and any(call.name in wanted for turn in task.ground_truth for call in turn)
    ]
    return found[: request.limit]


def added_event(task_id: str, origin: Origin) -> TaskAdded:
    return TaskAdded(id=derived_id("task-added", task_id), task_id=task_id, origin=origin)


def add_tasks(store: PoolStore, request: AddTasks) -> tuple[AddTasksReply, list[TaskAdded]]:
    """Adds new tasks; the reply, and an event for each task added."""
    added, duplicates = store.add_tasks(request.tasks)
    events = [added_event(t.id, t.origin) for t in request.tasks if t.id in added]
    return AddTasksReply(added=added, duplicates=duplicates), events


def record_verdict(store: PoolStore, verdict: Verdict) -> TaskAdded | None:
    """Records a judge's verdict; the event of the task it added, if any."""
    _, added_task_id = store.record_verdict(verdict)
    return None if added_task_id is None else added_event(added_task_id, verdict.task.origin)


# the failure agent's jobs are drawn from this many most recently failed tasks
FAILED_TASKS_DRAWN = 32


def rollout_jobs(
    store: PoolStore, missing: int, config: PoolStoreConfig, queue_seq: int, first_round: int
) -> list[RolloutJob]:
    """Up to ``missing`` jobs of tasks sampled by the store's sampler (with the configured
    mix, if one is set); their ids are unique per queue position (``queue_seq``) and
    round. Under the learnability sampler no task takes more than its capped share of the
    jobs, so fewer than ``missing`` may come back when few tasks can be drawn."""
    tasks = store.sample_batch(missing, config.mix, None, None, jobs=True)
    jobs = [
        RolloutJob(
            id=derived_id("job", task.id, queue_seq, first_round + i),
            task=task,
            group_size=config.group_size,
            experiences=job_experiences(store, task, config),
        )
        for i, task in enumerate(tasks, start=1)
    ]
    store.note_retrieved([e.id for job in jobs for e in job.experiences])
    if config.failure_agent_share > 0:
        failed = store.failed_tasks(FAILED_TASKS_DRAWN)
        jobs = [failure_agent_job(job, failed, config) or job for job in jobs]
    return jobs


def failure_agent_job(
    job: RolloutJob, failed: Sequence[Task], config: PoolStoreConfig
) -> RolloutJob | None:
    """The job handed to the failure agent instead, for ``failure_agent_share`` of the
    jobs (chosen by the job id's hash, so a re-fed job gets the same answer), on one of
    the tasks the target failed; None: it stays the target's."""
    if not failed or _unit(job.id, "agent") >= config.failure_agent_share:
        return None
    task = failed[int(_unit(job.id, "task") * len(failed))]
    return RolloutJob(
        id=derived_id("failure-job", job.id),
        task=task,
        group_size=config.group_size,
        agent="failure",
    )


def _unit(key: str, salt: str) -> float:
    """A number in [0, 1) fixed by ``key`` and ``salt``."""
    return int(derived_id(salt, key)[:13], 16) / 16**13


def job_experiences(store: PoolStore, task: Task, config: PoolStoreConfig) -> list[Experience]:
    """The kept experiences a job of ``task`` carries (none while there are none)."""
    ranked = rank_experiences(
        task,
        store.experiences(),
        config.experiences_per_job,
        config.experience_min_similarity,
    )
    return [experience for _, experience in ranked]


def experiences_reply(store: PoolStore, limit: int) -> ExperiencesReply:
    """The newest ``limit`` kept experiences, newest first, with how often jobs carried
    each."""
    kept = store.experiences()
    newest = kept[::-1][:limit]
    uses = store.experience_uses()
    return ExperiencesReply(
        experiences=newest, uses={e.id: uses.get(e.id, 0) for e in newest}, total=len(kept)
    )


def keep_experience(store: PoolStore, experience: Experience) -> bool:
    """Keeps the distiller's experience; False when it is already kept."""
    return store.add_experience(experience)


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


def unlabelled_seed(path: Path) -> list[Task]:
    """The pool of a run with no labels: D0's tasks from the file at ``path``, at depth 0
    (``explorer.max_parent_depth`` counts generations from them). For BFCL, a
    task that asks one of the dataset's own user turns is left out (it would carry a
    label into training). ConfigError when the file is missing or damaged."""
    try:
        d0 = load_d0(path)
    except D0Error as exc:
        raise ConfigError(f"labels: none: {exc}") from exc
    # D0's tasks are the run's seed tasks: synthesis generations count from them
    tasks = [
        msgspec.structs.replace(task, lineage=msgspec.structs.replace(task.lineage, depth=0))
        for task in d0.tasks
    ]
    if d0.environment == "bfcl":
        from coevolve.shared.envs.bfcl.tasks import labelled_turns, normalized_turn

        labelled = labelled_turns()
        kept = [
            task
            for task in tasks
            if not any(normalized_turn(turn) in labelled for turn in task.user_turns)
        ]
        if len(kept) < len(tasks):
            log.warning("D0: left out %d tasks that ask a BFCL user turn", len(tasks) - len(kept))
        tasks = kept
    return tasks


def labelled_tasks_in(store: PoolStore) -> int:
    """How many tasks of the pool were seeded from a labelled dataset (origin "seed"; the
    turns the labelled_control arm adds during a run with no labels are that arm's own)."""
    return store.seeded_labelled_tasks()
