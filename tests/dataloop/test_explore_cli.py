"""``coevolve explore``: seed-mode exploration requests published on a real NATS server."""

from __future__ import annotations

import json

import anyio
import pytest
import typer
from nats.js.errors import NotFoundError
from typer.testing import CliRunner

from coevolve.cli.explore_cmd import explore
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import load_tasks, seed_tasks, split_tasks
from coevolve.shared.messages import ExplorationRequest, decode
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import EXPLORATION_REQUESTS


def cli() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("explore")(explore)
    app.command("unused")(lambda: None)  # two commands: typer keeps the subcommand name
    return app


async def published_requests(settings: Settings) -> list[ExplorationRequest]:
    bus = await Bus.connect(settings.bus, name="test-explore")
    try:
        subscription = await bus.js.pull_subscribe(EXPLORATION_REQUESTS, durable="test-reader")
        messages = await subscription.fetch(10, timeout=2.0)
        return [decode(m.data, ExplorationRequest) for m in messages]
    finally:
        await bus.close()


def test_explore_publishes_one_request_per_train_task(
    settings: Settings, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", nats_server.url)
    result = CliRunner().invoke(
        cli(),
        [
            "explore",
            "--tasks",
            "2",
            "--rounds",
            "3",
            "--seed",
            "7",
            "--json",
            "--run-dir",
            str(settings.run_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output.strip().splitlines()[-1])
    requests = anyio.run(published_requests, settings)

    train_ids = {task.id for task in seed_tasks()}
    assert [r.id for r in requests] == [r["id"] for r in printed["requests"]]
    assert len(requests) == 2 and all(r.rounds == 3 for r in requests)
    assert all(r.task.id in train_ids for r in requests)
    assert len({r.task.id for r in requests}) == 2


def test_eval_entries_are_refused_before_anything_is_published(
    settings: Settings, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", nats_server.url)
    _, held_out = split_tasks(load_tasks("multi_turn_base"))
    result = CliRunner().invoke(
        cli(), ["explore", "--task", held_out[0].id, "--run-dir", str(settings.run_dir)]
    )
    assert result.exit_code == 2
    assert "not in the train split" in result.output
    with pytest.raises(NotFoundError):
        anyio.run(published_requests, settings)  # no stream: nothing was published


def test_unreachable_nats_is_a_clear_error(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:9")
    result = CliRunner().invoke(cli(), ["explore", "--run-dir", str(settings.run_dir)])
    assert result.exit_code == 1
    assert "cannot reach NATS" in result.output
