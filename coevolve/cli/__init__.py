"""The ``coevolve`` command line."""

from __future__ import annotations

import os
import sys
import warnings

import typer

from coevolve.cli import (
    bench,
    data_cmds,
    discover_cmd,
    eval_cmd,
    experiences_cmd,
    experiment,
    explore_cmd,
    report,
    serve,
    status,
    up,
)

# Libraries whose deprecation notices concern their own internals, not anything a user runs.
QUIET_LIBRARIES = ("transformers", "torch", "peft", "trl", "accelerate")


def quiet_libraries() -> None:
    """Hide the ML libraries' deprecation warnings and transformers' log below errors.

    The project's own warnings stay. Warning filters a user chose (``-W``,
    ``PYTHONWARNINGS``) and a ``TRANSFORMERS_VERBOSITY`` already set are kept. Services
    started by ``up`` inherit the variable.
    """
    if not sys.warnoptions:
        pattern = rf"({'|'.join(QUIET_LIBRARIES)})(\.|$)"
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=pattern)
    if "TRANSFORMERS_VERBOSITY" in os.environ:
        return
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    # transformers reads the variable once, when imported; set its level if that has happened.
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()


quiet_libraries()

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
app.command("discover")(discover_cmd.discover)
app.command("report")(report.report)
app.add_typer(experiment.experiment_app, name="experiment")
app.add_typer(data_cmds.tasks_app, name="tasks")
app.add_typer(experiences_cmd.experiences_app, name="experiences")


def main() -> None:
    app()
