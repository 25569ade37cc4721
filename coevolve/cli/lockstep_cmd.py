"""``coevolve up --schedule lockstep``: the lockstep schedule (``coevolve.schedules``) on
the run's pool file, printing a line a step.

Tasks come straight from the pool file (no services, no bus). After every
``synthesize_every`` learner steps (default: every step; 0: never) the data loop runs on
the steps' rollout groups (:class:`~coevolve.schedules.synthesis.LockstepSynthesis`); its
verdicts are recorded in the same pool file, so accepted tasks are sampled from the next
rollout on.
"""

from __future__ import annotations

from pathlib import Path

import typer

from coevolve.schedules.lockstep import IterationReport
from coevolve.schedules.lockstep import run_lockstep as run_schedule
from coevolve.schedules.synthesis import DEFAULT_MAX_SIGNALS, LockstepSynthesis
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import Task


def run_lockstep(
    run_dir: Path,
    pool_path: Path,
    iterations: int = 100,
    *,
    settings: Settings | None = None,
    synthesize_every: int = 1,
    max_signals: int = DEFAULT_MAX_SIGNALS,
    seed: int = 0,
) -> list[IterationReport]:
    """Run ``iterations`` lockstep steps on the pool at ``pool_path`` with the services'
    sections of ``settings`` (defaults when None); synthesis explores at most
    ``max_signals`` signals each time."""
    if synthesize_every < 0:
        raise typer.BadParameter(f"synthesize_every must be >= 0, got {synthesize_every}")
    settings = settings or Settings(run_dir=run_dir)
    with PoolStore(pool_path) as store:
        synthesis = (
            LockstepSynthesis(settings, store, max_signals=max_signals)
            if synthesize_every > 0
            else None
        )
        try:
            return run_schedule(
                settings,
                store,
                iterations=iterations,
                synthesizer=synthesis,
                synthesize_every=synthesize_every,
                seed=seed,
                report=show_iteration,
                on_new_tasks=announce_new_tasks,
                echo=typer.echo,
            )
        except ValueError as exc:  # an empty pool, a bad setting
            raise typer.BadParameter(str(exc)) from exc
        finally:
            if synthesis is not None:
                synthesis.close()


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
