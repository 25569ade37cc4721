"""learner: GRPO on rollout groups, new policy versions to the object store.

Groups are gathered until ``groups_per_step`` are in hand (or ``max_wait_s`` passed with at
least one); one optimizer step then trains on them, the new adapter weights go to the NATS
object store with a ``PolicyVersion`` announcement, and a checkpoint (weights, optimizer,
step, version, the ids of the groups trained on) is written atomically; the step's record
(the groups it trained on and dropped as stale) is appended to ``RUN_DIR/learner/
steps.jsonl``. Only then are the groups acked, so a learner killed with SIGKILL resumes
from its last step and the groups of the unfinished step come back to it; groups already
trained on are recognised and skipped.

Before any GRPO step the policy gets the SFT warm start on the pool's tasks with ground
truth (``warm_start``); it cannot be skipped: while no such task is reachable the service
reports a failed phase and retries. The SFT saves its position after every step, so a
killed learner resumes it where it stopped. The warm-started policy becomes the frozen KL
reference (GRPO trains a fresh adapter on top), its completion is recorded in the
checkpoint, and it is published as version 1. Then the ground truth of other seed tasks
is replayed as demonstrations, a little of it with every GRPO update (``demo_coef``).

With a preference objective (``grpo.objective`` eto or coevolving_dpo) each step also
needs the expert side of its groups' tasks: the learner asks the pool for each task once
and replays its ground truth as the warm start does (``preference_pairs.ExpertCache``).

A checkpoint is written before its version is announced, and an announcement's id
carries the weights' digest: a restarted learner never announces a version number twice.

With the failure agent (``grpo.preference.failure_agent``) its versions are announced the
same way on their own subject, and kept as ``RUN_DIR/policies/failure-v<N>.safetensors``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio
import msgspec

from coevolve.services.learner.config import LearnerServiceConfig
from coevolve.services.learner.handler import (
    NO_GRADIENT_PHASE,
    PACING_FILE,
    STEPS_FILE,
    keep_tasks,
    no_gradient_reason,
    record_step,
    record_wait,
    save_checkpoint,
    saved_tasks,
    train_step,
    trained_ids,
    version_to_announce,
    write_atomically,
)
from coevolve.services.learner.preference_pairs import ExpertCache, PairSide
from coevolve.services.learner.ranks import PolicySpec, Ranks, build_learner
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.config import Settings
from coevolve.shared.messages import (
    GRPO_STEP_PHASE,
    WAITING_FOR_DATA_PHASE,
    RolloutGroup,
    Task,
)
from coevolve.shared.pacing import PaceLedger
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery, ServiceFailed
from coevolve.shared.runtime.subjects import LEARNER_GROUPS_CONSUMER

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoints/learner.pt"
WARM_START_CHECKPOINT = "checkpoints/warm_start.pt"
WARM_START_TASKS = "checkpoints/warm_start.tasks.json"
DEMONSTRATION_TASKS = "checkpoints/demonstrations.tasks.json"
REMEMBERED_GROUPS = 4096
NO_TASKS_RETRY_S = (2.0, 30.0)  # first and longest wait before asking the pool again
RANK_WATCH_S = 1.0  # how often rank 0 looks at the other learner ranks


@dataclass
class _Waiting:
    group: RolloutGroup
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class LearnerActor(Actor):
    name = "learner"
    setup_timeout_s: ClassVar[float] = 3 * 3600.0  # the warm start runs in setup

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, LearnerServiceConfig)
        self.learner: GrpoLearner | None = None
        self.checkpoint = settings.path(CHECKPOINT)
        self._trained: deque[str] = deque(maxlen=REMEMBERED_GROUPS)
        self._waiting: list[_Waiting] = []
        self._steps_without_gradient = 0  # in a row, shown as the phase NO_GRADIENT_PHASE
        self._step_lock = anyio.Lock()
        self.last_metrics: StepMetrics | None = None
        self.ranks: Ranks | None = None
        self._rank_failure: str | None = None
        self._expert_cache: ExpertCache | None = None
        self._pace = PaceLedger(settings.pacing)

    # ------------------------------------------------------------------ start-up

    def policy_spec(self) -> PolicySpec:
        import torch

        return PolicySpec(
            model=self.config.model,
            device=self.config.device,
            finetune=self.config.finetune,
            grpo=msgspec.json.encode(self.config.grpo),
            run_dir=str(self.settings.run_dir),
            threads=torch.get_num_threads(),
            map_large_blocks=self.config.map_large_blocks,
        )

    async def setup(self) -> None:
        if self.config.world_size > 1:
            # started first, from this thread: they load their copies while this one does
            self.ranks = Ranks(self.config.world_size, self.policy_spec())
        self.learner = await anyio.to_thread.run_sync(self._load, abandon_on_cancel=True)
        if self.ranks is not None:
            ranks, device = self.ranks, self.learner.device
            await anyio.to_thread.run_sync(lambda: ranks.join_group(device), abandon_on_cancel=True)
        if self.checkpoint.exists():
            await anyio.to_thread.run_sync(self.learner.restore_checkpoint, self.checkpoint)
            self._trained.extend(trained_ids(self.checkpoint))
            log.info(
                "resumed at step %d, version %d", self.learner.step_count, self.learner.version
            )
        if self.config.warm_start.enabled:
            if not self.learner.warm_started and self.config.warm_start.from_policy:
                await self._adopt_warm_start()
            elif not self.learner.warm_started:
                await self._warm_start()
            replay = self.config.grpo.demo_coef > 0 and self.config.demo_tasks > 0
            if replay and self.config.grpo.objective == "grpo":  # GRPO's alone
                await self._load_demonstrations()
        if self.ranks is not None:
            ranks, learner = self.ranks, self.learner
            await anyio.to_thread.run_sync(lambda: ranks.sync(learner), abandon_on_cancel=True)
            log.info("%d learner ranks in step", self.config.world_size)
        await self._announce_if_newer()
        await self._announce_failure_agent()

    async def teardown(self) -> None:
        if self.ranks is not None:
            await anyio.to_thread.run_sync(self.ranks.stop, abandon_on_cancel=True)

    def _load(self) -> GrpoLearner:
        return build_learner(self.policy_spec(), self.settings.run_dir / "tensorboard" / "learner")

    def loops(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return (self._watch_ranks,) if self.config.world_size > 1 else ()

    async def _watch_ranks(self) -> None:
        """End the service when a rank is lost: it restarts from its last checkpoint."""
        while True:
            dead = self.ranks.dead() if self.ranks is not None else []
            if dead or self._rank_failure:
                reason = ", ".join(dead) or self._rank_failure
                raise ServiceFailed(f"learner rank lost: {reason}; restart from the checkpoint")
            await anyio.sleep(RANK_WATCH_S)

    def _step(self, groups: list[RolloutGroup], experts: dict[str, PairSide] | None) -> StepMetrics:
        assert self.learner is not None
        try:
            return train_step(self.learner, groups, self.ranks, experts)
        except Exception as exc:
            if self.ranks is not None:  # a collective failed: the ranks are out of step for good
                self._rank_failure = repr(exc)
            raise

    async def _warm_start(self) -> None:
        from coevolve.services.learner.memory import peak_resident_gb
        from coevolve.services.learner.warm_start import run_warm_start

        learner = self.learner
        assert learner is not None
        tasks = await self._warm_start_tasks()
        settings = self.config.warm_start
        log.info(
            "warm start: SFT on %d tasks for %d epochs, at least %d steps",
            len(tasks),
            settings.epochs,
            settings.min_steps,
        )
        self.report_progress("warm start", 0, None, f"{len(tasks)} tasks")

        def progress(step: int, total: int, loss: float) -> None:
            self.report_progress("warm start", step, total, f"loss {loss:.3f}")

        checkpoint = self.settings.path(WARM_START_CHECKPOINT)
        # abandon on cancel: SIGTERM must not wait for a long SFT pass
        report = await anyio.to_thread.run_sync(
            lambda: run_warm_start(
                learner.policy, tasks, settings, progress=progress, checkpoint=checkpoint
            ),
            abandon_on_cancel=True,
        )
        log.info(
            "warm start done: %d examples, %d steps, loss %.3f -> %.3f in %.0f s, "
            "peak resident %.1f GB",
            report.examples,
            report.steps,
            report.first_loss,
            report.final_loss,
            report.duration_s,
            peak_resident_gb(),
        )
        learner.freeze_reference()
        learner.version = max(learner.version, 1)
        await anyio.to_thread.run_sync(self._save_checkpoint)
        for name in (WARM_START_CHECKPOINT, WARM_START_TASKS):
            self.settings.path(name).unlink(missing_ok=True)

    async def _adopt_warm_start(self) -> None:
        from coevolve.services.learner.warm_start import adopt_warm_start

        learner, settings = self.learner, self.config.warm_start
        assert learner is not None and settings.from_policy is not None
        path = settings.from_policy
        digest = await anyio.to_thread.run_sync(
            lambda: adopt_warm_start(learner, path, settings.from_policy_sha256)
        )
        log.info("warm start adopted from %s (sha256 %s)", path, digest[:12])
        await anyio.to_thread.run_sync(self._save_checkpoint)

    async def _load_demonstrations(self) -> None:
        from coevolve.services.learner.warm_start import DEMONSTRATIONS_SEED, demonstrations

        learner = self.learner
        assert learner is not None
        tasks = await self._seed_tasks(
            DEMONSTRATION_TASKS, self.config.demo_tasks, DEMONSTRATIONS_SEED, "demonstrations"
        )
        examples = await anyio.to_thread.run_sync(
            lambda: demonstrations(learner.policy, tasks, self.config.warm_start),
            abandon_on_cancel=True,
        )
        learner.set_demonstrations(examples)
        log.info("demonstration replay: %d examples of %d tasks", len(examples), len(tasks))

    async def _warm_start_tasks(self) -> list[Task]:
        """The warm start's tasks: those of an interrupted warm start, else fresh from the
        pool (see ``_seed_tasks``)."""
        count = self.config.warm_start.tasks
        return await self._seed_tasks(WARM_START_TASKS, count, 0, "warm start")

    async def _seed_tasks(self, saved_name: str, count: int, seed: int, phase: str) -> list[Task]:
        """``count`` tasks with ground truth of the demonstration origin (the labelled seed
        tasks; D0's with no labels) drawn from the pool with ``seed``, kept in
        ``saved_name`` so a restarted learner gets the same. Until the pool has some this
        reports a failed ``phase`` and retries (it never goes on without them)."""
        from coevolve.shared.pool_client import PoolClient
        from coevolve.shared.runtime.backoff import Backoff

        saved = self.settings.path(saved_name)
        kept = saved_tasks(saved)
        if kept is not None:
            return kept
        pool = PoolClient(self.bus)
        backoff = Backoff(*NO_TASKS_RETRY_S)
        while True:
            try:
                tasks = await self._tasks_with_ground_truth(pool, count, seed)
                reason = "no task with ground truth in the pool"
            except Exception as exc:  # pool-store not up yet
                tasks, reason = [], f"pool-store did not answer: {exc!r}"
            if tasks:
                keep_tasks(saved, tasks)
                return tasks
            wait = backoff.next_delay()
            log.warning("%s failed: %s; retrying in %.0f s", phase, reason, wait)
            self.report_progress(f"{phase} failed", detail=f"{reason}; retrying in {wait:.0f} s")
            await anyio.sleep(wait)

    async def _tasks_with_ground_truth(self, pool: Any, count: int, seed: int) -> list[Task]:
        from coevolve.services.learner.warm_start import (
            OVERSAMPLE,
            demonstration_origin,
            warm_start_tasks,
        )

        settings = self.config.warm_start
        origin = demonstration_origin(self.settings.labels)
        sampled: list[Task] = await pool.sample(OVERSAMPLE * count, mix={origin: 1.0}, seed=seed)
        return warm_start_tasks(sampled, settings, count)

    async def _experts(self, groups: Sequence[RolloutGroup]) -> dict[str, PairSide] | None:
        """A preference objective's expert sides for the groups' tasks (None under GRPO):
        the tasks from the pool, each replayed once (``ExpertCache``)."""
        from coevolve.shared.pool_client import PoolClient

        if self.config.grpo.objective == "grpo":
            return None
        assert self.learner is not None
        if self._expert_cache is None:
            self._expert_cache = ExpertCache(self.learner.policy, self.config.warm_start)
        cache = self._expert_cache
        missing = cache.missing(g.task_id for g in groups)
        if missing:
            pool = PoolClient(self.bus)
            tasks: list[Task] = []
            for task_id in missing:
                try:
                    task = await pool.get(task_id)
                except Exception as exc:  # the pool-store is restarting: try next step
                    log.warning("no expert for task %s this step: %r", task_id, exc)
                    continue
                if task is not None:
                    tasks.append(task)
            await anyio.to_thread.run_sync(cache.build, tasks, abandon_on_cancel=True)
        return cache.experts(g.task_id for g in groups)

    async def _announce_if_newer(self) -> None:
        from coevolve.shared.policy import weights_digest
        from coevolve.shared.policy_sync import latest_policy

        learner = self.learner
        assert learner is not None
        announced = await latest_policy(self.bus)

        def digest() -> str:
            return weights_digest(learner.export_weights())

        version = await anyio.to_thread.run_sync(
            version_to_announce, learner.version, announced, digest
        )
        if version is None:
            return
        if version != learner.version:
            log.warning(
                "checkpoint at version %d but v%d was announced with other weights: "
                "publishing as v%d",
                learner.version,
                version - 1,
                version,
            )
            learner.version = version
            await anyio.to_thread.run_sync(self._save_checkpoint)
        await self._publish_weights()

    async def _publish_weights(self) -> None:
        """Weights to the object store (announced) and to RUN_DIR/policies/v<N>.safetensors."""
        from coevolve.shared.policy_sync import publish_policy

        learner = self.learner
        assert learner is not None
        blob = await anyio.to_thread.run_sync(learner.export_weights)
        write_atomically(self.settings.path("policies", f"v{learner.version}.safetensors"), blob)
        await publish_policy(
            self.bus,
            blob,
            version=learner.version,
            step=learner.step_count,
            base_model=learner.policy.name,
            kind=self.config.finetune,
            keep=self.config.bus_versions,
        )

    async def _announce_failure_agent(self) -> None:
        """The failure agent's weights to the object store, announced on its own subject,
        unless the bus has this version with these weights already (see
        ``version_to_announce``)."""
        from coevolve.shared.policy import weights_digest
        from coevolve.shared.policy_sync import latest_policy, publish_policy

        learner = self.learner
        assert learner is not None
        agent = learner.failure_agent
        if agent is None:
            return
        blob = await anyio.to_thread.run_sync(agent.export, learner)
        announced = await latest_policy(self.bus, "failure")
        version = version_to_announce(agent.version, announced, lambda: weights_digest(blob))
        if version is None:
            return
        if version != agent.version:
            agent.version = version
            await anyio.to_thread.run_sync(self._save_checkpoint)
        write_atomically(self.settings.path("policies", f"failure-v{version}.safetensors"), blob)
        await publish_policy(
            self.bus,
            blob,
            version=version,
            step=agent.step_count,
            base_model=learner.policy.name,
            kind=self.config.finetune,
            agent="failure",
            keep=self.config.bus_versions,
        )

    def _save_checkpoint(self) -> None:
        assert self.learner is not None
        save_checkpoint(self.learner, self.checkpoint, self._trained)

    def _record_step(
        self, groups: list[RolloutGroup], metrics: StepMetrics, version_before: int
    ) -> None:
        """Append the step's line to ``steps.jsonl``; a failed write is logged, not fatal
        (the step is checkpointed already, and its weights must still be published)."""
        try:
            record_step(
                self.settings.path(STEPS_FILE),
                groups,
                metrics,
                version_before=version_before,
                max_staleness=self.config.grpo.max_staleness,
            )
        except OSError as exc:
            log.warning("step %d not recorded in %s: %r", metrics.step, STEPS_FILE, exc)

    # ------------------------------------------------------------------ training

    def consumers(self) -> Sequence[Consumer[Any]]:
        # two steps' groups in hand: the next step's gather while one trains (with one
        # step's, a 1-group step let only 1 more in and the steps alternated 3, 1, 3, 1)
        in_hand = 2 * self.config.grpo.groups_per_step
        return (Consumer(LEARNER_GROUPS_CONSUMER, RolloutGroup, self.on_group, in_hand),)

    async def on_group(self, group: RolloutGroup, _: Delivery) -> None:
        if group.id in self._trained:
            return  # trained on before a crash; the ack was what got lost
        waiting = _Waiting(group)
        self._waiting.append(waiting)
        if len(self._waiting) < self.config.grpo.groups_per_step:
            with anyio.move_on_after(self.config.max_wait_s):
                await waiting.done.wait()
        # a step takes at most groups_per_step of those waiting: train until ours is done
        while not waiting.done.is_set():
            await self._train()
        if waiting.error is not None:
            raise RuntimeError(f"learner step failed: {waiting.error!r}") from waiting.error

    async def _keep_pace(self) -> None:
        """Hold the next step while the data loop is behind the pacing contract (at most
        ``pacing.max_wait_s``, then not again until it delivers: ``PaceLedger``): on shared
        cores the loop then gets them. Each wait goes to ``RUN_DIR/learner/pacing.jsonl``."""
        pacing, ledger = self.settings.pacing, self._pace
        learner = self.learner
        if not pacing.waits or learner is None:
            return
        from coevolve.shared.pool_client import PoolClient

        pool = PoolClient(self.bus)
        steps_done = learner.step_count
        owed = ledger.owed(steps_done)
        started = anyio.current_time()
        delivered = short = 0
        with anyio.move_on_after(pacing.max_wait_s):
            while True:
                try:
                    delivered = (await pool.stats()).accepted_candidates
                except Exception as exc:  # pool-store away: training goes on
                    log.warning("pacing: pool-store did not answer: %r", exc)
                    return
                short = ledger.shortfall(steps_done, delivered)
                owed = ledger.owed(steps_done)
                if not short:
                    break
                self.report_progress(
                    WAITING_FOR_DATA_PHASE,
                    delivered,
                    owed,
                    detail=f"the data loop is {short} accepted tasks behind",
                )
                await anyio.sleep(pacing.poll_s)
        if short:
            ledger.stall(delivered)
            log.warning(
                "pacing: the data loop is still %d accepted tasks behind after %.0f s; "
                "steps go on without waiting until it delivers another",
                short,
                pacing.max_wait_s,
            )
        waited = anyio.current_time() - started
        if waited >= pacing.poll_s:
            record_wait(
                self.settings.path(PACING_FILE),
                step=steps_done + 1,
                waited_s=waited,
                delivered=delivered,
                owed=owed,
                ran_out=bool(short),
            )
        self.clear_progress()

    async def _train(self) -> None:
        async with self._step_lock:
            await self._keep_pace()
            per_step = self.config.grpo.groups_per_step
            batch, self._waiting = self._waiting[:per_step], self._waiting[per_step:]
            if not batch:
                return
            learner = self.learner
            assert learner is not None
            self.report_progress(GRPO_STEP_PHASE, detail=f"{len(batch)} groups")
            groups = [w.group for w in batch]
            version_before = learner.version
            no_gradient: str | None = None
            try:
                experts = await self._experts(groups)
                metrics = await anyio.to_thread.run_sync(
                    self._step, groups, experts, abandon_on_cancel=True
                )
                self.last_metrics = metrics
                no_gradient = None if metrics.trained else no_gradient_reason(groups)
                self._trained.extend(w.group.id for w in batch)
                # checkpoint first: an announced version always exists on disk
                await anyio.to_thread.run_sync(self._save_checkpoint)
                # then the step's record (what `coevolve report` counts as trained on)
                await anyio.to_thread.run_sync(self._record_step, groups, metrics, version_before)
                if metrics.trained:
                    await self._publish_weights()
                await self._announce_failure_agent()
                for name, value in metrics.scalars().items():
                    await self.metric(name, value, step=metrics.step)
            except Exception as exc:
                log.exception("learner step failed")
                for waiting in batch:
                    waiting.error = exc
            finally:
                self.clear_progress()
                if no_gradient is not None:
                    self._steps_without_gradient += 1
                    self.report_progress(
                        NO_GRADIENT_PHASE, self._steps_without_gradient, detail=no_gradient
                    )
                    log.warning("step without a gradient: %s", no_gradient)
                else:
                    self._steps_without_gradient = 0
                for waiting in batch:
                    waiting.done.set()


def build(settings: Settings) -> Actor:
    return LearnerActor(settings)
