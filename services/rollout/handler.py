"""Rollout's work without the bus: a rollout job in, its group and scores out; with
``step_credit`` on, the group's steps labelled by the attributor role before it goes out.
A job that carries experiences has ``navigation.share`` of its episodes sampled with them
in the prompt (``shared/experience``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec

from coevolve.services.rollout.config import RolloutConfig, StepCreditConfig
from coevolve.shared.attribution import label_group
from coevolve.shared.envs import make_environment
from coevolve.shared.episodes import Navigation, run_group
from coevolve.shared.experience import guidance_text
from coevolve.shared.llm import RoleLLM
from coevolve.shared.messages import (
    Agent,
    RolloutGroup,
    RolloutJob,
    RolloutResults,
    ScoreSample,
    Task,
    derived_id,
)
from coevolve.shared.policy import SamplingParams
from coevolve.shared.structured import RejectionCounter

log = logging.getLogger(__name__)

# labelled: every trajectory asked (an unusable answer leaves its labels empty);
# uniform_skipped: equal rewards and ``label_uniform_groups`` off; timed_out, failed: the
# group goes out unlabelled
AttributionOutcome = Literal["labelled", "uniform_skipped", "timed_out", "failed"]


@dataclass(frozen=True)
class RolledOut:
    group: RolloutGroup  # for the learner and the signal monitor
    results: RolloutResults  # its scores, for pool-store's history


def step_budget(config: RolloutConfig, task: Task) -> int:
    """Assistant messages an episode of ``task`` may take."""
    budget = config.max_steps_per_turn * max(1, len(task.user_turns))
    return min(budget, config.max_steps or budget)


def sampling_params(config: RolloutConfig) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        stop=tuple(config.stop),
    )


def navigation_plan(job: RolloutJob, config: RolloutConfig) -> list[Navigation | None] | None:
    """Which of the job's episodes carry its experiences (the first ones); None when none
    does."""
    guided = config.navigation.guided(job.group_size) if job.experiences else 0
    if not guided:
        return None
    advice = Navigation(guidance_text(job.experiences), [e.id for e in job.experiences])
    return [advice] * guided + [None] * (job.group_size - guided)


def roll_out(
    engine: Any, job: RolloutJob, config: RolloutConfig, agent: Agent = "target"
) -> RolledOut:
    """``job.group_size`` episodes of the job's task with the engine's current policy,
    ``agent``'s."""
    environment = job.task.environment
    trajectories = run_group(
        engine,
        lambda: make_environment(environment),
        job.task,
        job.group_size,
        sampling_params(config),
        max_steps=step_budget(config, job.task),
        id_prefix=job.id,
        partial_credit=config.partial_credit,
        navigation=navigation_plan(job, config),
    )
    version = engine.policy_version
    group = RolloutGroup(
        id=derived_id("group", job.id),
        task_id=job.task.id,
        origin=job.task.origin,
        policy_version=version,
        trajectories=trajectories,
        job_id=job.id,
        agent=agent,
    )
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
    results = RolloutResults(id=derived_id("results", job.id), group_id=group.id, samples=samples)
    return RolledOut(group, results)


@dataclass(frozen=True)
class Attributed:
    group: RolloutGroup  # with ``step_labels`` and ``label_s`` when labelled
    outcome: AttributionOutcome
    seconds: float  # the attributor's time on the group, a failed try's included


async def attribute_steps(
    group: RolloutGroup,
    task: Task,
    llm: RoleLLM,
    config: StepCreditConfig,
    counter: RejectionCounter | None = None,
) -> Attributed:
    """``group`` with its steps labelled by the attributor (``shared/attribution``).

    Never loses the group: when labelling fails (the endpoint down, past ``timeout_s``,
    any error) the group comes back unlabelled, with the seconds spent on it.
    """
    rewards = group.rewards()
    if not config.label_uniform_groups and (not rewards or max(rewards) == min(rewards)):
        return Attributed(group, "uniform_skipped", 0.0)
    started = time.perf_counter()
    outcome: AttributionOutcome = "labelled"
    labelled = group
    try:
        with anyio.fail_after(config.timeout_s):
            labelled = await label_group(group, task, llm, counter)
    except TimeoutError:
        outcome = "timed_out"
        log.warning(
            "group %s: step labelling took over %.0f s; published unlabelled",
            group.id,
            config.timeout_s,
        )
    except Exception as exc:  # labelling is an extra: whatever breaks it, the group goes out
        outcome = "failed"
        log.warning("group %s: step labelling failed (%r); published unlabelled", group.id, exc)
    seconds = time.perf_counter() - started
    if outcome != "labelled":
        labelled = group
    return Attributed(msgspec.structs.replace(labelled, label_s=seconds), outcome, seconds)
