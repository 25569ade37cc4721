"""One real lockstep iteration: real model, real BFCL episodes, a real GRPO step."""

from __future__ import annotations

import pytest
import torch

from coevolve.bench.short_tasks import build_tasks
from coevolve.schedules.lockstep import (
    LockstepConfig,
    LockstepLoop,
    TaskCycle,
    informative_groups,
)
from coevolve.services.learner.config import LearnerConfig
from coevolve.shared.messages import RolloutGroup, Task
from coevolve.shared.policy import load_policy
from tests.support.cache import CACHE_DIR
from tests.support.messages import untokenized_trajectory


def test_one_iteration_rolls_out_learns_and_serves_the_new_version() -> None:
    torch.manual_seed(0)
    policy = load_policy(run_dir=CACHE_DIR, device="cpu")
    tasks = build_tasks(2, seed=0, prefix="lockstep")
    synthesized: list[list[RolloutGroup]] = []

    def synthesize(groups: list[RolloutGroup]) -> list[Task]:
        synthesized.append(groups)
        return build_tasks(1, seed=9, prefix="new")

    cycle = TaskCycle(tasks)
    loop = LockstepLoop(
        policy,
        cycle,
        LockstepConfig(
            tasks_per_step=1, group_size=2, max_new_tokens=6, max_steps=1, synthesize_every=1
        ),
        # equal rewards (the base model scores 0) still take a real optimizer step
        LearnerConfig(drop_uniform_groups=False, lr=1e-3),
        synthesize=synthesize,
        on_new_tasks=cycle.add,
    )
    report = loop.iteration()
    second = loop.iteration()
    loop.close()

    assert report.metrics.trained and report.metrics.trajectories == 2
    assert loop.learner.version == 2 and loop.engine.policy_version == 2
    # the second rollout ran under version 1, the learner's version then: on-policy
    assert second.metrics.staleness_max == 0 and second.metrics.trained
    assert report.rollout_s > 0 and report.learn_s > 0
    assert len(synthesized) == 2 and len(synthesized[0]) == 1
    assert report.new_tasks == 1 and len(cycle.tasks) == 4


def test_refill_samples_fresh_tasks_while_every_group_ties() -> None:
    """The base model scores 0 on every sample: each refill round draws a fresh task, and
    the step, with nothing informative, trains on nothing."""
    torch.manual_seed(0)
    policy = load_policy(run_dir=CACHE_DIR, device="cpu")
    cycle = TaskCycle(build_tasks(3, seed=0, prefix="refill"))
    loop = LockstepLoop(
        policy,
        cycle,
        LockstepConfig(
            tasks_per_step=1, group_size=2, max_new_tokens=6, max_steps=1, refill_rounds=2
        ),
    )
    report = loop.iteration()
    loop.close()

    assert report.groups_sampled == 3 and report.reward_mean == 0.0
    assert not report.metrics.trained and report.metrics.uniform_groups == 3
    assert not cycle.queue  # all three tasks were drawn, each once


def group_of(task: Task, rewards: list[float]) -> RolloutGroup:
    """A group of ``task`` with these rewards (only the rewards matter to the refill)."""
    episodes = [
        untokenized_trajectory(f"{task.id}-{i}", task.id, reward=reward, policy_version=1)
        for i, reward in enumerate(rewards)
    ]
    return RolloutGroup(
        task_id=task.id, origin=task.origin, policy_version=1, trajectories=episodes
    )


def test_refill_keeps_only_informative_groups_once_enough_came() -> None:
    tasks = build_tasks(4, seed=0, prefix="refill")
    # the first and third task tie, the second and fourth do not
    rewards = {tasks[0].id: [0.0, 0.0], tasks[1].id: [0.0, 1.0], tasks[2].id: [1.0, 1.0]}
    rewards[tasks[3].id] = [1.0, 0.0]
    drawn: list[tuple[int, list[str]]] = []

    def sample(chosen: list[Task], refill: int) -> list[RolloutGroup]:
        drawn.append((refill, [t.id for t in chosen]))
        return [group_of(t, rewards[t.id]) for t in chosen]

    queue = iter(tasks)
    groups, sampled = informative_groups(
        lambda count: [next(queue) for _ in range(count)], sample, wanted=2, refill_rounds=3
    )

    # round 0: two tasks, one ties; round 1: one task, it ties; round 2: one, informative
    assert drawn == [(0, [tasks[0].id, tasks[1].id]), (1, [tasks[2].id]), (2, [tasks[3].id])]
    assert [g.task_id for g in groups] == [tasks[1].id, tasks[3].id]
    assert len(sampled) == 4


def test_refill_rounds_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="refill_rounds"):
        LockstepConfig(refill_rounds=-1)
