"""rollout: takes rollout jobs, runs a group of K episodes, publishes the group.

Replicas share the job queue. Between episodes a worker hot-swaps to the newest policy
version announced by the learner. Before taking on a job it waits while the learner has
more than ``max_unconsumed_groups`` groups it has not consumed yet (backpressure).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.js.errors import NotFoundError

from coevolve.shared.actor import Actor, Consumer, Delivery
from coevolve.shared.config import EngineKind, Settings
from coevolve.shared.messages import (
    PolicyVersion,
    RolloutGroup,
    RolloutJob,
    RolloutResults,
    ScoreSample,
    Task,
    decode,
    derived_id,
)
from coevolve.shared.subjects import (
    LEARNER_GROUPS_CONSUMER,
    POLICY_UPDATES,
    ROLLOUT_GROUPS,
    ROLLOUT_JOBS_CONSUMER,
    ROLLOUT_RESULTS,
)
from coevolve.shared.toolcalls import CLOSE_TAG

log = logging.getLogger(__name__)


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    # llama_cpp: the CPU engine (a float GGUF base, each policy version as a LoRA adapter);
    # transformers: torch + peft in process; vllm: GPUs
    engine: EngineKind = "llama_cpp"
    device: str | None = None
    # CPU threads of the llama_cpp engine (None: torch's, i.e. OMP_NUM_THREADS)
    threads: int | None = None
    # two BFCL calls in one message take ~100 tokens; a cut call scores 0
    max_new_tokens: int = 128
    # an unsolved episode's reward: this times its share of matched ground-truth calls
    # (0: BFCL's 0/1 only). A policy that solves nothing yet still gets a gradient; kept
    # under the signal threshold (0.5), so a reward above it still means solved
    partial_credit: float = 0.4
    temperature: float = 1.0
    top_p: float = 1.0
    # a message ends once one of these is in its text: the agent makes one call a message,
    # and nothing after a call's closing tag acts before the tool answers
    stop: list[str] = msgspec.field(default_factory=lambda: [CLOSE_TAG])
    # assistant messages an episode may take per user turn: one per call and the closing
    # reply (the warm start's format), so a per-turn task gets 4 (94% of BFCL's base turns
    # have at most 3 calls) and a 4-turn entry 16 ...
    max_steps_per_turn: int = 4
    # ... and at most this many in all (None: no cap beyond the per-turn budget)
    max_steps: int | None = None
    max_unconsumed_groups: int = 16
    backpressure_poll_s: float = 0.5
    # take no job before the learner's first announced policy (its warm start): the base
    # model calls no tool, so its groups all score 0 and only take CPU from the warm start
    wait_for_policy: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.partial_credit < 1.0:
            raise ValueError(f"rollout.partial_credit must be in [0, 1), got {self.partial_credit}")


class RolloutActor(Actor):
    name = "rollout"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, RolloutConfig)
        self.engine: Any = None
        self._announced: PolicyVersion | None = None
        # announcements whose weights failed their digest: not fetched again
        self._refused: set[tuple[str, str]] = set()
        self.throttled_s = 0.0

    async def setup(self) -> None:
        from coevolve.shared.policy_sync import latest_policy

        self.engine = await anyio.to_thread.run_sync(self._load_engine, abandon_on_cancel=True)
        self._announced = await latest_policy(self.bus)
        await self._swap_if_newer()

    async def teardown(self) -> None:
        # a group abandoned at shutdown stops at its next token instead of running on
        interrupt = getattr(self.engine, "interrupt", None)
        if interrupt is not None:
            interrupt()

    def _load_engine(self) -> Any:
        from coevolve.shared.policy.factory import build_engine

        return build_engine(
            self.config.engine,
            model=self.config.model,
            run_dir=self.settings.run_dir,
            device=self.config.device,
            threads=self.config.threads,
        )

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (Consumer(ROLLOUT_JOBS_CONSUMER, RolloutJob, self.on_job),)

    def loops(self) -> Sequence[Callable[[], Awaitable[None]]]:
        return (self.watch_policy_updates,)

    async def watch_policy_updates(self) -> None:
        sub = await self.bus.nc.subscribe(POLICY_UPDATES)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=5)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                update = decode(msg.data, PolicyVersion)
                if self._announced is None or update.version > self._announced.version:
                    self._announced = update
        finally:
            with anyio.move_on_after(2, shield=True):
                await sub.unsubscribe()

    async def _swap_if_newer(self) -> None:
        from coevolve.shared.policy_sync import PolicySyncError, fetch_policy

        update = self._announced
        if update is None or update.version <= self.engine.policy_version:
            return
        if (update.object_name, update.sha256) in self._refused:
            return
        try:
            blob = await fetch_policy(self.bus, update)
        except PolicySyncError as exc:
            # keep sampling with the weights we have; a later announcement may be good
            self._refused.add((update.object_name, update.sha256))
            log.error(
                "refused policy v%d: %s; staying on v%d",
                update.version,
                exc,
                self.engine.policy_version,
            )
            await self.metric("refused_policy_versions", float(len(self._refused)))
            return
        await anyio.to_thread.run_sync(self.engine.load_weights, blob, update.version)
        log.info("hot-swapped to policy version %d", update.version)

    def step_budget(self, task: Task) -> int:
        budget = self.config.max_steps_per_turn * max(1, len(task.user_turns))
        return min(budget, self.config.max_steps or budget)

    async def _wait_for_policy(self) -> None:
        if not self.config.wait_for_policy or self._announced is not None:
            return
        self.report_progress("waiting for the first policy (learner warm start)")
        while self._announced is None:
            await anyio.sleep(self.config.backpressure_poll_s)
        self.clear_progress()

    async def _wait_for_learner(self) -> None:
        spec = LEARNER_GROUPS_CONSUMER
        while True:
            try:
                with anyio.fail_after(5):
                    info = await self.bus.js.consumer_info(spec.stream, spec.durable)
            except (TimeoutError, NotFoundError):
                return
            backlog = int(info.num_pending) + int(info.num_ack_pending)
            if backlog <= self.config.max_unconsumed_groups:
                return
            self.throttled_s += self.config.backpressure_poll_s
            await anyio.sleep(self.config.backpressure_poll_s)

    async def on_job(self, job: RolloutJob, _: Delivery) -> None:
        from coevolve.shared.envs import make_environment
        from coevolve.shared.episodes import run_group
        from coevolve.shared.policy import SamplingParams

        await self._wait_for_policy()
        await self._wait_for_learner()
        await self._swap_if_newer()
        params = SamplingParams(
            max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            stop=tuple(self.config.stop),
        )
        environment = job.task.environment
        trajectories = await anyio.to_thread.run_sync(
            lambda: run_group(
                self.engine,
                lambda: make_environment(environment),
                job.task,
                job.group_size,
                params,
                max_steps=self.step_budget(job.task),
                id_prefix=job.id,
                partial_credit=self.config.partial_credit,
            ),
            abandon_on_cancel=True,
        )
        version = self.engine.policy_version
        group = RolloutGroup(
            id=derived_id("group", job.id),
            task_id=job.task.id,
            origin=job.task.origin,
            policy_version=version,
            trajectories=trajectories,
            job_id=job.id,
        )
        await self.publish(ROLLOUT_GROUPS, group)
        samples = [
            ScoreSample(
                task_id=job.task.id,
                policy_version=version,
                score=t.reward,
                length=sum(t.loss_mask),
                generate_s=t.timings.generate_s,
                environment_s=t.timings.environment_s,
            )
            for t in trajectories
        ]
        results = RolloutResults(
            id=derived_id("results", job.id), group_id=group.id, samples=samples
        )
        await self.publish(ROLLOUT_RESULTS, results)


def build(settings: Settings) -> Actor:
    return RolloutActor(settings)
