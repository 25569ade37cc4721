"""``coevolve report RUN_DIR``: one run as Markdown with PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def report(
    run_dir: Annotated[
        Path,
        typer.Argument(
            help="The run's directory (holds pool.duckdb, tensorboard/, traces/, logs/).",
            exists=True,
            file_okay=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Where to write report.md and its PNGs (default RUN_DIR/report)."
        ),
    ] = None,
) -> None:
    """Render a report of one run: is the loop alive, is the policy learning.

    Reads only files: the DuckDB pool (tasks by origin, verdicts and their reasons, rollout
    scores), the learner's TensorBoard scalars (reward, KL, staleness, uniform groups),
    the trace spans (time per stage, signals received), the signal monitor's state and the
    logs. Works on a finished run or a live one (a pool file held by a running pool-store
    is read from a copy). Parts with no data yet say "none yet".
    """
    from coevolve.report.run_report import render_run_report  # matplotlib: only when used

    path = render_run_report(run_dir, out)
    typer.echo(str(path))
