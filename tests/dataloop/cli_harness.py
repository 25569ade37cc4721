"""The data commands' tests: a run's pool file with one seed task, and the commands run
against that run and its NATS server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from typer.testing import CliRunner

from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import Task
from tests.dataloop.dataloop_harness import filesystem_seed_tasks

Invoke = Callable[..., tuple[int, str, str]]


def seeded_pool_file(settings: Settings, fill: Callable[[PoolStore, Task], object]) -> Path:
    """The run's pool.duckdb: one filesystem seed task and what ``fill`` adds for it."""
    task = filesystem_seed_tasks(1)[0]
    path = settings.run_dir / "pool.duckdb"
    with PoolStore(path) as store:
        store.add_tasks([task])
        fill(store, task)
    return path


def invoker(cli: Callable[[], typer.Typer]) -> Invoke:
    """``invoke(settings, *args)``: the app of ``cli`` run with ``args`` on the run of
    ``settings``; its exit code, stdout and stderr."""

    def invoke(settings: Settings, *args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(
            cli(), [*args, "--run-dir", str(settings.run_dir)], env={"NATS_URL": settings.bus.url}
        )
        return result.exit_code, result.stdout, result.stderr

    return invoke
