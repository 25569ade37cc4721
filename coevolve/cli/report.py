"""``coevolve report RUN_DIR``: one run as Markdown with PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from coevolve.cli.options import ConfigOption, existing_directory
from coevolve.shared.config import EngineKind


def report(
    run_dir: Annotated[
        Path,
        existing_directory(
            "The run's directory (holds pool.duckdb, tensorboard/, traces/, logs/)."
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Where to write report.md and its PNGs (default RUN_DIR/report)."
        ),
    ] = None,
    repair_samples: Annotated[
        int,
        typer.Option(
            "--repair-samples",
            min=0,
            help="Also measure the repair: play every parent of an accepted task, and as "
            "many seed tasks that raised no signal, N times each with policy v1 and with "
            "the last policy (sampled like rollout); saved as repair-measured.json in the "
            "report directory and reused while the run has the same versions and tasks.",
        ),
    ] = 0,
    repair_engine: Annotated[
        EngineKind,
        typer.Option(
            "--repair-engine",
            help="The engine that plays the measured repair: llama_cpp (CPU) | "
            "transformers | vllm (GPU).",
        ),
    ] = "llama_cpp",
    config: ConfigOption = None,
) -> None:
    """Render a report of one run: is the loop alive, is the policy learning, what did the
    rollouts draw, and did training on a child raise its parent.

    Reads only files: the DuckDB pool (tasks by origin with their lineage, verdicts and
    their reasons, rollout scores), the learner's TensorBoard scalars (reward, KL when
    one was computed, staleness, uniform groups) and its step records
    (learner/steps.jsonl: groups trained on, dropped stale, left waiting), the evaluator's
    held-out scores when it ran (eval/*), the trace spans (time per stage, signals
    received), the signal monitor's state and the logs.
    Works on a finished run or a live one (a pool file held by a running pool-store is
    read from a copy). Parts with no data yet say "none yet". With --repair-samples N it
    also plays policies (the run's configuration: --config): slow, and opt-in.
    """
    # matplotlib and the policies: only when used
    from coevolve.report.run_report import render_run_report

    target = out or run_dir / "report"
    if repair_samples > 0:
        _measure_repair(run_dir, target, repair_samples, repair_engine, config)
    path = render_run_report(run_dir, target)
    typer.echo(str(path))


def _measure_repair(
    run_dir: Path, out: Path, samples: int, engine: EngineKind, config: Path | None
) -> None:
    import os

    from coevolve.cli.options import settings_from
    from coevolve.report.repair import MEASURED_FILE, measure_repair, policy_play
    from coevolve.report.run_data import load_run
    from coevolve.shared.envs.rendering import configure_tool_rendering

    settings = settings_from(config, run_dir)
    configure_tool_rendering(settings.tool_rendering)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        measure_repair(
            load_run(run_dir),
            samples,
            policy_play(run_dir, settings, engine),
            out / MEASURED_FILE,
            describe={"engine": engine},
            log=lambda line: typer.echo(line, err=True),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--repair-samples") from exc
