"""``coevolve up --schedule lockstep``: rollout, then learn, in turn, in this one process.

Tasks come straight from the pool-store file (no services, no bus). Synthesis (the data
loop) is not run by this command: ``LockstepLoop`` takes it as an optional hook.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import typer

from coevolve.services.learner.trainer import LearnerConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.lockstep import IterationReport, LockstepConfig, LockstepLoop
from coevolve.shared.messages import Task
from coevolve.shared.policy import load_policy


def run_lockstep(
    run_dir: Path,
    pool_path: Path,
    iterations: int = 100,
    *,
    model: str | None = None,
    tasks_per_step: int = 2,
    group_size: int = 4,
    max_new_tokens: int = 256,
    max_steps: int = 12,
    learner: LearnerConfig | None = None,
    seed: int = 0,
) -> list[IterationReport]:
    """Run ``iterations`` lockstep iterations on tasks sampled from the pool at ``pool_path``.

    The policy is loaded (and cached) under ``run_dir``; TensorBoard scalars go to
    ``run_dir/tensorboard/lockstep``. One torch thread unless OMP_NUM_THREADS says otherwise.
    """
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    store = PoolStore(pool_path)
    draws = 0

    def sample(count: int) -> list[Task]:
        nonlocal draws
        draws += 1
        tasks = store.sample_batch(count, environment="bfcl", seed=seed * 1_000_003 + draws)
        if not tasks:
            raise typer.BadParameter(f"the pool at {pool_path} has no active bfcl task")
        return tasks

    loop = LockstepLoop(
        load_policy(model, run_dir=run_dir),
        sample,
        LockstepConfig(
            tasks_per_step=tasks_per_step,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            max_steps=max_steps,
            seed=seed,
        ),
        learner,
        log_dir=run_dir / "tensorboard" / "lockstep",
    )

    def show(report: IterationReport) -> None:
        m = report.metrics
        typer.echo(
            f"step {report.step}: reward {report.reward_mean:.3f} trained={m.trained} "
            f"kl {m.kl:.4f} rollout {report.rollout_s:.1f} s learn {report.learn_s:.1f} s"
        )

    try:
        return loop.run(iterations, show)
    finally:
        loop.close()
        store.close()
