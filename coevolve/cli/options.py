"""Options shared by several commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from coevolve.shared.config import ConfigError, Settings, load_settings

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="YAML configuration file (also COEVOLVE_CONFIG).", show_default=False
    ),
]
RunDirOption = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="Where the run keeps its state: DuckDB pool, NATS store, logs, traces, "
        "checkpoints (also COEVOLVE_RUN_DIR). Default: runs/default.",
        show_default=False,
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on the last line of stdout.")
]


def existing_directory(help: str) -> Any:
    """A command's argument that names a directory, which must exist."""
    return typer.Argument(help=help, exists=True, file_okay=False)


def settings_from(config: Path | None, run_dir: Path | None) -> Settings:
    try:
        return load_settings(config, run_dir=str(run_dir) if run_dir else None)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
