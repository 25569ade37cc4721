"""The read-only CLI commands work as the `reader` user against a running pool-store,
and the server refuses nothing they do."""

from __future__ import annotations

import json

import anyio
import anyio.from_thread
import pytest
import typer
from typer.testing import CliRunner

from coevolve.shared.actor import ActorRunner
from coevolve.shared.bus import Bus
from coevolve.shared.config import Settings
from coevolve.shared.credentials import USER_ENV
from coevolve.shared.messages import Task
from coevolve.shared.nats_server import NatsServer
from coevolve.shared.permissions import READER
from coevolve.shared.pool_client import PoolClient


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
    from coevolve.services.pool_store.actor import PoolStoreActor
    from coevolve.services.pool_store.store import PoolStore

    with PoolStore(settings.run_dir / "pool.duckdb") as store:
        store.add_tasks([seed_task()])
    settings.services["pool_store"] = {"feed_jobs": False}
    runner = ActorRunner(PoolStoreActor(settings))
    with anyio.from_thread.start_blocking_portal() as portal:
        portal.start_task_soon(lambda: runner.run(handle_signals=False))

        async def answering() -> None:
            bus = await Bus.connect(settings.bus, "probe")
            try:
                with anyio.fail_after(30):
                    while True:
                        try:
                            await PoolClient(bus, timeout_s=2).stats()
                            return
                        except Exception:
                            await anyio.sleep(0.1)
            finally:
                await bus.close()

        portal.call(answering)
        monkeypatch.setenv(USER_ENV, READER)  # what a CLI process uses unless told otherwise
        try:
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
        finally:
            portal.call(runner.request_stop)
    assert nats_server.log_file is not None
    assert "Violation" not in nats_server.log_file.read_text()
