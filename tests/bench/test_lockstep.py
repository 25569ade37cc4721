"""One real lockstep iteration: real model, real BFCL episodes, a real GRPO step."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from coevolve.bench.short_tasks import build_tasks
from coevolve.schedules.lockstep import LockstepConfig, LockstepLoop, TaskCycle
from coevolve.services.learner.trainer import LearnerConfig
from coevolve.shared.messages import RolloutGroup, Task
from coevolve.shared.policy import load_policy

CACHE_DIR = Path(
    os.environ.get("COEVOLVE_TEST_CACHE", Path(__file__).resolve().parents[2] / "runs/test-cache")
)


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
