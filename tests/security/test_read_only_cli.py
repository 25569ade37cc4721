"""The read-only CLI commands work as the `reader` user against a running pool-store,
and the server refuses nothing they do."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from coevolve.shared.config import Settings
from coevolve.shared.messages import Task
from coevolve.shared.runtime.credentials import USER_ENV
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.permissions import READER
from tests.support.pool_store import pool_store_in_portal


def cli() -> typer.Typer:
    from coevolve.cli import data_cmds, status

    app = typer.Typer(add_completion=False)
    app.command("status")(status.status)
    app.command("signals")(data_cmds.signals)
    app.add_typer(data_cmds.tasks_app, name="tasks")
    return app


def seed_task() -> Task:
    return Task(id="seed-1", environment="bfcl", user_turns=["List the files here."])


def test_status_tasks_and_signals_run_as_the_reader(
    settings: Settings, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coevolve.services.pool_store.store import PoolStore

    with PoolStore(settings.run_dir / "pool.duckdb") as store:
        store.add_tasks([seed_task()])
    settings.services["pool_store"] = {"feed_jobs": False}
    with pool_store_in_portal(settings):
        monkeypatch.setenv(USER_ENV, READER)  # what a CLI process uses unless told otherwise
        env = {"NATS_URL": nats_server.url}
        args = ["--run-dir", str(settings.run_dir)]
        result = CliRunner().invoke(cli(), ["status", *args, "--json"], env=env)
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout.splitlines()[-1])
        assert [s["service"] for s in report["services"]] == ["pool_store"]
        result = CliRunner().invoke(cli(), ["tasks", "list", *args, "--json"], env=env)
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["source"] == "pool-store sample"
        result = CliRunner().invoke(cli(), ["signals", *args, "--seconds", "0.3"], env=env)
        assert result.exit_code == 0, result.stderr
    assert nats_server.log_file is not None
    assert "Violation" not in nats_server.log_file.read_text()
