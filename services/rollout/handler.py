"""Rollout's work without the bus: a rollout job in, its group and scores out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coevolve.services.rollout.config import RolloutConfig
from coevolve.shared.envs import make_environment
from coevolve.shared.episodes import run_group
from coevolve.shared.messages import (
    RolloutGroup,
    RolloutJob,
    RolloutResults,
    ScoreSample,
    Task,
    derived_id,
)
from coevolve.shared.policy import SamplingParams


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


def roll_out(engine: Any, job: RolloutJob, config: RolloutConfig) -> RolledOut:
    """``job.group_size`` episodes of the job's task with the engine's current policy."""
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
    )
    version = engine.policy_version
    group = RolloutGroup(
        id=derived_id("group", job.id),
        task_id=job.task.id,
        origin=job.task.origin,
        policy_version=version,
        trajectories=trajectories,
        job_id=job.id,
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
