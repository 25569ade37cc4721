"""``coevolve up --schedule lockstep``: rollout, then learn, then synthesize, in turn, in
this one process (the paper's schedule).

Tasks come straight from the pool-store file (no services, no bus). After every
``synthesize_every`` learner steps (default: every step; 0: never) the data loop runs on
the step's rollout groups (``lockstep_synthesis.LockstepSynthesis``: signals, exploration,
abstraction, judging, with the services' functions and configuration sections); its
verdicts are recorded in the same pool file, so accepted tasks are sampled from the next
rollout on.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import typer

from coevolve.cli.lockstep_synthesis import DEFAULT_MAX_SIGNALS, LockstepSynthesis
from coevolve.services.learner.actor import LearnerServiceConfig, WarmStartConfig
from coevolve.services.learner.sft import warm_start
from coevolve.services.learner.trainer import LearnerConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.lockstep import IterationReport, LockstepConfig, LockstepLoop
from coevolve.shared.messages import Task
from coevolve.shared.policy import LoadedPolicy, export_weights, import_weights, load_policy

# the warm-started adapter, kept so a restarted lockstep run does not train it again
WARM_START_WEIGHTS = Path("lockstep") / "warm_start.safetensors"


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
    settings: Settings | None = None,
    synthesize_every: int = 1,
    max_signals: int = DEFAULT_MAX_SIGNALS,
) -> list[IterationReport]:
    """Run ``iterations`` lockstep iterations on tasks sampled from the pool at ``pool_path``.

    The policy is loaded (and cached) under ``run_dir``; TensorBoard scalars go to
    ``run_dir/tensorboard/lockstep``. One torch thread unless OMP_NUM_THREADS says otherwise.
    Synthesis reads its LLM roles and service sections from ``settings`` (defaults when
    None) and explores at most ``max_signals`` signals each time. Before the first step
    the policy gets the SFT warm start of the ``learner`` section, once per run directory.
    """
    if synthesize_every < 0:
        raise typer.BadParameter(f"synthesize_every must be >= 0, got {synthesize_every}")
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

    settings = settings or Settings(run_dir=run_dir)
    policy = load_policy(model, run_dir=run_dir)
    warm_start_once(policy, store, run_dir, settings.section("learner", LearnerServiceConfig))
    synthesis = (
        LockstepSynthesis(settings, store, max_signals=max_signals)
        if synthesize_every > 0
        else None
    )
    try:
        loop = LockstepLoop(
            policy,
            sample,
            LockstepConfig(
                tasks_per_step=tasks_per_step,
                group_size=group_size,
                max_new_tokens=max_new_tokens,
                max_steps=max_steps,
                synthesize_every=synthesize_every,
                seed=seed,
            ),
            learner,
            log_dir=run_dir / "tensorboard" / "lockstep",
            synthesize=synthesis,
            on_new_tasks=announce_new_tasks,
        )
        try:
            return loop.run(iterations, show_iteration)
        finally:
            loop.close()
    finally:
        if synthesis is not None:
            synthesis.close()
        store.close()


def warm_start_once(
    policy: LoadedPolicy, store: PoolStore, run_dir: Path, config: LearnerServiceConfig
) -> bool:
    """SFT warm start on the pool's tasks with ground truth, once per run directory (as
    the learner service does on its first start); later starts load the saved adapter.
    Returns whether the policy is warm-started."""
    path = run_dir / WARM_START_WEIGHTS
    if path.is_file():
        import_weights(policy.model, path.read_bytes())
        typer.echo(f"warm start: loaded {path}")
        return True
    settings: WarmStartConfig = config.warm_start
    if not settings.enabled:
        return False
    tasks = [
        task
        for task in store.sample_batch(settings.tasks, environment="bfcl", seed=0)
        if task.ground_truth
    ]
    if not tasks:
        typer.echo("warm start: no task with ground truth in the pool; skipped", err=True)
        return False
    typer.echo(f"warm start: SFT on {len(tasks)} tasks for {settings.epochs} epoch(s)")
    report = warm_start(
        policy,
        tasks,
        epochs=settings.epochs,
        lr=settings.lr,
        batch_size=settings.batch_size,
        max_len=settings.max_len,
        progress=True,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(export_weights(policy.model))
    os.replace(partial, path)  # a run killed mid-write trains again instead of loading half
    typer.echo(f"warm start: loss {report.first_loss:.3f} -> {report.final_loss:.3f}, {path}")
    return True


def announce_new_tasks(tasks: list[Task]) -> None:
    """The synthesis already recorded them in the pool (with their lineage): name them."""
    for task in tasks:
        kind = task.lineage.signal_kind or "?"
        typer.echo(f"  new {task.origin} task {task.id} ({kind}): {task.description[:80]}")


def show_iteration(report: IterationReport) -> None:
    m = report.metrics
    typer.echo(
        f"step {report.step}: reward {report.reward_mean:.3f} trained={m.trained} "
        f"kl {m.kl:.4f} rollout {report.rollout_s:.1f} s learn {report.learn_s:.1f} s "
        f"synthesize {report.synthesize_s:.1f} s new tasks {report.new_tasks}"
    )
