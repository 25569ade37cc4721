"""The ``coevolve`` command line."""

from __future__ import annotations

import typer

from coevolve.cli import (
    bench,
    data_cmds,
    eval_cmd,
    experiment,
    explore_cmd,
    report,
    serve,
    status,
    up,
)

app = typer.Typer(
    name="coevolve",
    help=(
        "Train tool-using LLM agents while their training data evolves with them.\n\n"
        "Start everything with `coevolve up`; watch it with `coevolve status`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("up")(up.up)
app.command("serve")(serve.serve)
app.command("status")(status.status)
app.command("bench")(bench.bench)
app.command("eval")(eval_cmd.eval_command)
app.command("signals")(data_cmds.signals)
app.command("explore")(explore_cmd.explore)
app.command("report")(report.report)
app.add_typer(experiment.experiment_app, name="experiment")
app.add_typer(data_cmds.tasks_app, name="tasks")


def main() -> None:
    app()
