"""``coevolve discover``: build D0, the task set of a run with no labels, into one file."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from coevolve.cli.options import ConfigOption, JsonOption, RunDirOption, settings_from
from coevolve.shared.config import Settings
from coevolve.shared.llm import LLMServerError, LLMUnavailable
from coevolve.shared.task_sets import D0Error, D0File, load_d0


def d0_summary(d0: D0File, path: Path) -> dict[str, object]:
    """The file's identity and the build's counts, as ``--json`` prints them."""
    return {
        "file": str(path),
        "sha256": d0.sha256,
        "environment": d0.environment,
        "classes": d0.classes,
        "role_model": d0.role_model,
        "code_version": d0.code_version,
        "tasks": len(d0.tasks),
        "explorations_per_task": d0.explorations_per_task,
        **msgspec.to_builtins(d0.build),
    }


def build_d0(settings: Settings, out: Path, echo: bool = True, first_tasks_of: int = 0) -> D0File:
    """Run the build (resuming an interrupted one), printing one line per exploration;
    ``first_tasks_of``: see ``D0Build``."""
    from coevolve.schedules.discovery import run_discovery

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log_file = settings.path("logs", "discover.log")
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(os.environ.get("COEVOLVE_LOG_LEVEL", "INFO"))
    if echo:
        typer.echo(f"[d0] details (rewrites, drops, verdicts): {log_file}", err=True)

    def progress(line: str) -> None:
        if echo:
            typer.echo(f"[d0] {line}", err=True)

    try:
        return run_discovery(settings, out, progress, first_tasks_of)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (LLMServerError, LLMUnavailable) as exc:
        typer.echo(
            f"error: the LLM roles are unavailable: {exc}\n(D0 is built with d0.role_model "
            f"{settings.d0.role_model!r}; set it to null to use the llm section's model)",
            err=True,
        )
        raise typer.Exit(1) from exc
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def ensure_d0(settings: Settings) -> Path:
    """The run's D0 file, checked; built first (with progress lines) when missing."""
    path = settings.d0.path(settings.run_dir)
    if not path.is_file():
        first = settings.d0.tasks_before_training
        typer.echo(
            f"[d0] no D0 at {path}: discovering its first {first} tasks (d0.first_tasks), "
            "then training starts and discovery goes on beside it",
            err=True,
        )
        first_only = msgspec.structs.replace(settings.d0, tasks=first)
        build_d0(
            msgspec.structs.replace(settings, d0=first_only),
            path,
            first_tasks_of=settings.d0.tasks if first < settings.d0.tasks else 0,
        )
    try:
        d0 = load_d0(path)
    except D0Error as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"[d0] {len(d0.tasks)} tasks from {path} (sha256 {d0.sha256[:12]}, "
        f"role model {d0.role_model})",
        err=True,
    )
    return path


def d0_option(setting: str, help: str, min: float | None = None) -> Any:
    """An option that overrides the ``d0`` setting ``setting`` for this build."""
    return typer.Option(f"--{setting.replace('_', '-')}", help=f"{help} (d0.{setting}).", min=min)


def discover(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Where to write D0 (default: the d0.file setting, d0.json in the run "
            "directory). An interrupted build resumes from OUT.partial.jsonl.",
            show_default=False,
        ),
    ] = None,
    tasks: Annotated[
        int | None, d0_option("tasks", "Stop at this many accepted tasks", min=1)
    ] = None,
    max_explorations: Annotated[
        int | None, d0_option("max_explorations", "At most this many explorations", min=1)
    ] = None,
    max_minutes: Annotated[
        float | None, d0_option("max_minutes", "Stop after this long", min=0.1)
    ] = None,
    environment: Annotated[
        str | None,
        d0_option("environment", "The environment to explore: bfcl or one under `environments:`"),
    ] = None,
    json_output: JsonOption = False,
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """Build D0 with no labels: unguided exploration of the environment's initial states,
    each exploration abstracted and judged like synthesized tasks, the accepted tasks
    written to one file with their lineage, the role model, the code version and a sha256.

    `coevolve up --labels none` starts from this file (and builds it first when it is
    missing). It reads no question or answer of the environment's dataset: only its
    initial states, its tools and the role LLMs.
    """
    settings = settings_from(config, run_dir)
    overrides = {
        key: value
        for key, value in {
            "tasks": tasks,
            "max_explorations": max_explorations,
            "max_minutes": max_minutes,
            "environment": environment,
        }.items()
        if value is not None
    }
    if overrides:
        try:
            settings.d0 = msgspec.structs.replace(settings.d0, **overrides)
            settings.d0.__post_init__()
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    path = out.expanduser().resolve() if out else settings.d0.path(settings.run_dir)
    d0 = build_d0(settings, path)
    summary = d0_summary(d0, path)
    typer.echo(
        f"D0: {len(d0.tasks)} tasks in {d0.build.minutes:.1f} min from "
        f"{d0.build.explorations} explorations ({d0.build.ended_by}) -> {path}",
        err=True,
    )
    if json_output:
        typer.echo(json.dumps(summary))
