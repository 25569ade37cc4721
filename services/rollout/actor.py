"""rollout: takes rollout jobs, runs a group of K episodes, publishes the group.

Replicas share the job queue. Between episodes a worker hot-swaps to the newest policy
version announced by the learner, of the agent the job names (``policies``: the target,
or the co-evolving failure agent of ``learner.grpo.preference.failure_agent``, whose
groups carry no results to pool-store, nor step labels: its scores are not the
target's). Before taking on a job it waits while the learner has more than
``max_unconsumed_groups`` groups it has not consumed yet (backpressure).
With ``step_credit`` on, the attributor LLM role labels each group's steps before it is
published (the worker would mostly be waiting for the learner meanwhile); a group whose
labelling fails is published unlabelled.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
from nats.js.errors import NotFoundError

from coevolve.services.rollout.config import RolloutConfig
from coevolve.services.rollout.handler import attribute_steps, roll_out
from coevolve.services.rollout.policies import AgentPolicies
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients, RoleLLM
from coevolve.shared.messages import (
    WAITING_FOR_DATA_PHASE,
    Agent,
    Heartbeat,
    PolicyVersion,
    RolloutGroup,
    RolloutJob,
    Task,
    decode,
    now,
)
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery
from coevolve.shared.runtime.subjects import (
    LEARNER_GROUPS_CONSUMER,
    ROLLOUT_GROUPS,
    ROLLOUT_JOBS_CONSUMER,
    ROLLOUT_RESULTS,
    heartbeat_subject,
)
from coevolve.shared.structured import RejectionCounter

log = logging.getLogger(__name__)

AGENTS: tuple[Agent, ...] = ("target", "failure")


class RolloutActor(Actor):
    name = "rollout"

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, RolloutConfig)
        self.engine: Any = None
        self.policies = AgentPolicies(self._fetch, self._load_weights)
        self.throttled_s = 0.0
        self.learner_beat: Heartbeat | None = None
        # the attributor role (step credit on only); clients given are closed by their maker
        self._own_llm = llm is None
        self.llm = llm
        if llm is None and self.config.step_credit.enabled:
            self.llm = RoleClients.from_section(
                settings.services.get("llm"), settings.run_dir, roles=("attributor",)
            )
        self.attributions = RejectionCounter()
        self.step_credit_s = 0.0

    async def setup(self) -> None:
        from coevolve.shared.policy_sync import latest_policy

        self.engine = await anyio.to_thread.run_sync(self._load_engine, abandon_on_cancel=True)
        for agent in AGENTS:
            if (update := await latest_policy(self.bus, agent)) is not None:
                self.policies.hear(agent, update)
        await self._use("target")

    async def teardown(self) -> None:
        # a group abandoned at shutdown stops at its next token instead of running on
        interrupt = getattr(self.engine, "interrupt", None)
        if interrupt is not None:
            interrupt()
        if self._own_llm and self.llm is not None:
            await self.llm.aclose()

    @property
    def attributor(self) -> RoleLLM | None:
        if self.llm is None or not self.config.step_credit.enabled:
            return None
        return self.llm["attributor"]

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
        watches = tuple(partial(self.watch_policy_updates, agent) for agent in AGENTS)
        return (*watches, self.watch_learner)

    async def watch_learner(self) -> None:
        """Keep the learner's last heartbeat: whether it holds its step for data."""
        sub = await self.bus.nc.subscribe(heartbeat_subject("learner"))
        try:
            async for msg in sub.messages:
                self.learner_beat = decode(msg.data, Heartbeat)
        finally:
            with anyio.move_on_after(2, shield=True):
                await sub.unsubscribe()

    def backlog_limit(self) -> int:
        """Unconsumed groups before rollout waits: more while the learner waits for the
        data loop (its heartbeat, if recent, says so)."""
        beat = self.learner_beat
        recent = 5 * self.settings.runtime.heartbeat_interval_s
        if (
            beat is not None
            and beat.phase == WAITING_FOR_DATA_PHASE
            and now() - beat.sent_at < recent
        ):
            return self.config.max_unconsumed_groups_while_learner_waits
        return self.config.max_unconsumed_groups

    async def watch_policy_updates(self, agent: Agent) -> None:
        from coevolve.shared.policy_sync import updates_subject

        sub = await self.bus.nc.subscribe(updates_subject(agent))
        try:
            # the iterator, not next_msg(timeout), which can lose a message as it times out
            async for msg in sub.messages:
                self.policies.hear(agent, decode(msg.data, PolicyVersion))
        finally:
            with anyio.move_on_after(2, shield=True):
                await sub.unsubscribe()

    async def _fetch(self, update: PolicyVersion) -> bytes:
        from coevolve.shared.policy_sync import fetch_policy

        return await fetch_policy(self.bus, update)

    async def _load_weights(self, blob: bytes, version: int) -> None:
        await anyio.to_thread.run_sync(self.engine.load_weights, blob, version)

    async def _use(self, agent: Agent) -> Agent:
        """The newest weights of ``agent`` in the engine (see ``policies``)."""
        refused = len(self.policies.refused)
        used = await self.policies.use(agent)
        if len(self.policies.refused) != refused:
            await self.metric("refused_policy_versions", float(len(self.policies.refused)))
        return used

    async def _wait_for_policy(self) -> None:
        if not self.config.wait_for_policy or "target" in self.policies.announced:
            return
        self.report_progress("waiting for the first policy (learner warm start)")
        while "target" not in self.policies.announced:
            await anyio.sleep(self.config.backpressure_poll_s)
        self.clear_progress()

    async def _wait_for_learner(self) -> None:
        spec = LEARNER_GROUPS_CONSUMER
        waited = 0.0
        while True:
            try:
                with anyio.fail_after(5):
                    info = await self.bus.js.consumer_info(spec.stream, spec.durable)
            except (TimeoutError, NotFoundError):
                break
            backlog = int(info.num_pending) + int(info.num_ack_pending)
            if backlog <= self.backlog_limit():
                break
            if not waited:
                log.info("waiting: the learner has %d groups unconsumed", backlog)
            waited += self.config.backpressure_poll_s
            await anyio.sleep(self.config.backpressure_poll_s)
        if waited:
            self.throttled_s += waited
            log.info("waited %.0f s for the learner (%.0f s in all)", waited, self.throttled_s)
            await self.metric("throttled_s", self.throttled_s)

    async def on_job(self, job: RolloutJob, _: Delivery) -> None:
        await self._wait_for_policy()
        await self._wait_for_learner()
        agent = await self._use(job.agent)
        engine, config = self.engine, self.config
        rolled = await anyio.to_thread.run_sync(
            lambda: roll_out(engine, job, config, agent), abandon_on_cancel=True
        )
        group = rolled.group
        if (attributor := self.attributor) is not None and agent == "target":
            group = await self._attribute(group, job.task, attributor)
        await self.publish(ROLLOUT_GROUPS, group)
        if agent == "target":
            await self.publish(ROLLOUT_RESULTS, rolled.results)

    async def _attribute(
        self, group: RolloutGroup, task: Task, attributor: RoleLLM
    ) -> RolloutGroup:
        """The group with its steps labelled (unlabelled when that fails); the attributor's
        seconds go out as ``step_credit_s`` (running total) and ``step_credit_group_s``."""
        self.report_progress("labelling steps", detail=f"group {group.id[:8]}")
        rejected_before = dict(self.attributions.rejected)
        try:
            attributed = await attribute_steps(
                group, task, attributor, self.config.step_credit, self.attributions
            )
        finally:
            self.clear_progress()
        self.step_credit_s += attributed.seconds
        await self.metric("step_credit_s", self.step_credit_s)
        await self.metric("step_credit_group_s", attributed.seconds, outcome=attributed.outcome)
        for kind, count in self.attributions.rejected.items():
            if count != rejected_before.get(kind, 0):
                await self.metric("llm_rejections", count, role="attributor", kind=kind)
        return attributed.group


def build(settings: Settings) -> Actor:
    return RolloutActor(settings)
