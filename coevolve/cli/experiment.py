"""``coevolve experiment``: the synthesis ablation (``ablation``) and its report (``report``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from coevolve.cli.options import existing_directory
from coevolve.experiment import ARMS

# the experiment's modules are imported by the commands: they pull in matplotlib and the
# bench helpers (which import this CLI package: a cycle at import time)
experiment_app = typer.Typer(
    help="The synthesis ablation: does signal-guided synthesis beat random synthesis at "
    "equal volume? See docs/experiment.md.",
    no_args_is_help=True,
)

DEFAULT_OUT = Path("runs/experiments/ablation")

BaseConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML configuration every run starts from (the warm start too); each arm or "
        "point lays its own settings over it.",
        exists=True,
        dir_okay=False,
    ),
]
BaseRunDirOption = Annotated[
    Path, typer.Option(help="A run directory whose converted model cache (models/) is reused.")
]


def _parse_arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise typer.BadParameter(f"choose from {', '.join(ARMS)}", param_hint="--arms")
    if "random" in arms and "coevolve" not in arms:
        raise typer.BadParameter("random is paced on coevolve: run both", param_hint="--arms")
    return arms


@experiment_app.command("ablation")
def ablation(
    arms: Annotated[
        str,
        typer.Option(
            help="Comma-separated arms: none, random, coevolve (synthesis); navigate, "
            "attribute, both (mechanisms, on top of coevolve); eto, coevolving_dpo "
            "(learner objectives instead of GRPO, on top of coevolve); labelled_control "
            "(no-label setting only: none plus labelled train turns at the pacing rate); "
            "navigate_off, navigate_on (no synthesis; the distiller off or on)."
        ),
    ] = "none,random,coevolve",
    seeds: Annotated[int, typer.Option(help="Seeds per arm (0 .. S-1).", min=1)] = 3,
    minutes: Annotated[
        float,
        typer.Option(help="Wall minutes of each arm x seed run (the cap with --steps).", min=0.1),
    ] = 30.0,
    steps: Annotated[
        int | None,
        typer.Option(
            help="End each arm once its learner has taken this many steps: arms equal in "
            "learner steps rather than minutes.",
            min=1,
            show_default=False,
        ),
    ] = None,
    eval_tasks: Annotated[
        int | None,
        typer.Option(
            help="Held-out bfcl-turns-base eval-split turns per evaluation: one seeded "
            "sample, the same for every policy (default: every eval-split turn of the "
            "world).",
            min=1,
            show_default=False,
        ),
    ] = None,
    eval_max_steps: Annotated[
        int,
        typer.Option(
            help="Assistant messages per held-out task (coevolve eval "
            "--max-steps-per-turn); a per-turn task needs one per call and one reply.",
            min=1,
        ),
    ] = 4,
    eval_every: Annotated[
        float, typer.Option(help="Minutes between the policies kept for evaluation.", min=0.1)
    ] = 10.0,
    out: Annotated[
        Path, typer.Option(help="Working directory: run directories, kept policies.")
    ] = DEFAULT_OUT,
    results: Annotated[
        Path | None,
        typer.Option(
            help="Where the results go: the warm start, each arm x seed's result, the "
            "report; small enough to commit, and what a resume on another machine reads "
            "(default: OUT/results).",
            show_default=False,
        ),
    ] = None,
    max_runs: Annotated[
        int | None,
        typer.Option(
            help="Run at most this many of the pending arm x seed runs, in order, then "
            "stop: a job with a time limit takes one run at a time.",
            min=1,
            show_default=False,
        ),
    ] = None,
    config: BaseConfigOption = None,
    base_run_dir: BaseRunDirOption = Path("runs/default"),
) -> None:
    """Run every arm x seed not finished yet (or the first --max-runs), then write the report.

    One warm start (a first `coevolve up` until policy v1 exists, or the one already in
    RESULTS) is adopted by every arm's learner, its sha256 checked. Each arm x seed is a
    real `coevolve up` for --minutes (or --steps learner steps); the policy current at
    every --eval-every mark and at the end is scored on the held-out split after the run
    stops. Each writes RESULTS/<arm>-s<seed>.json; re-running the same command skips
    those, so an interrupted experiment resumes, on this machine or on a fresh clone
    that has RESULTS.
    """
    from coevolve.experiment.ablation import ExperimentSpec, ResultsMismatchError, run_experiment
    from coevolve.experiment.aggregate import render_experiment_report

    spec = ExperimentSpec(
        arms=_parse_arms(arms),
        seeds=tuple(range(seeds)),
        minutes=minutes,
        eval_tasks=eval_tasks,
        eval_every_minutes=eval_every,
        base_config=str(config.resolve()) if config else None,
        eval_max_steps=eval_max_steps,
        steps=steps,
    )
    try:
        spec.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--arms") from exc
    results = results or out / "results"
    try:
        run_experiment(spec, out, results, base_run_dir, log=typer.echo, max_runs=max_runs)
    except ResultsMismatchError as exc:
        raise typer.BadParameter(str(exc), param_hint="--results") from exc
    typer.echo(str(render_experiment_report(results)))


@experiment_app.command("report")
def report(
    results: Annotated[
        Path, existing_directory("The experiment's results directory (--results of ablation).")
    ],
    report_dir: Annotated[
        Path | None,
        typer.Option("--to", help="Where to write report.md and PNGs (default RESULTS/report)."),
    ] = None,
) -> None:
    """Aggregate whatever arm x seed results exist into Markdown + PNGs (from the result
    files alone: it works on a fresh clone)."""
    from coevolve.experiment.aggregate import render_experiment_report

    typer.echo(str(render_experiment_report(results, report_dir)))


@experiment_app.command("sweep")
def sweep(
    points: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated points to run (default: every point, in order): "
            "default, lr-1e-4, lr-1e-3, groups-2, groups-8, wait-120, kl-0.01, lr-5e-5, "
            "temp-0.7.",
            show_default=False,
        ),
    ] = None,
    minutes: Annotated[
        float, typer.Option(help="Wall minutes of each point's run.", min=0.1)
    ] = 20.0,
    tune_tasks: Annotated[
        int,
        typer.Option(
            help="Train-split bfcl-turns-base turns each policy is scored on (one seeded "
            "sample, the same for every point).",
            min=1,
        ),
    ] = 80,
    out: Annotated[Path, typer.Option(help="The sweep directory (resumable).")] = Path(
        "runs/experiments/sweep"
    ),
    config: BaseConfigOption = None,
    base_run_dir: BaseRunDirOption = Path("runs/default"),
    report_only: Annotated[
        bool, typer.Option("--report-only", help="Only print the table of the finished points.")
    ] = False,
) -> None:
    """The learner sweep: GRPO settings, one at a time, each for --minutes from one warm start.

    Each point is a `coevolve up` without explorers, started from a copy of the shared
    warm start; its last policy and v1 are scored on the same train-split turns (no
    held-out turn chooses a setting), and the point reports last - v1 per measure with a
    paired interval and p-value. Finished points (OUT/<point>-s0/result.json) are skipped,
    so an interrupted sweep resumes; the table goes to OUT/report.md.
    """
    from coevolve.experiment.sweep import (
        POINTS,
        SweepMismatchError,
        SweepSpec,
        parse_points,
        render_sweep_report,
        run_sweep,
    )

    if not report_only:
        try:
            names = parse_points(points) if points else tuple(p.name for p in POINTS)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--points") from exc
        spec = SweepSpec(
            points=names,
            minutes=minutes,
            tune_tasks=tune_tasks,
            base_config=str(config.resolve()) if config else None,
        )
        try:
            run_sweep(spec, out, base_run_dir, log=typer.echo)
        except SweepMismatchError as exc:
            raise typer.BadParameter(str(exc), param_hint="--out") from exc
    if not out.is_dir():
        raise typer.BadParameter(f"{out} is not a sweep directory", param_hint="--out")
    typer.echo(render_sweep_report(out.resolve()))
