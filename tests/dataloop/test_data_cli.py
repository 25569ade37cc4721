"""``coevolve signals`` and ``coevolve tasks list|show|lineage`` against a real NATS server,
a real pool-store and a real DuckDB file."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anyio
import msgspec
import pytest
import typer

from coevolve.cli.data_cmds import signals, tasks_app
from coevolve.shared.config import Settings
from coevolve.shared.messages import (
    Signal,
    Task,
    ToolCall,
    Verdict,
)
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import signal_subject
from tests.dataloop.cli_harness import invoker, seeded_pool_file
from tests.dataloop.dataloop_harness import filesystem_seed_tasks, mixed_group
from tests.support.messages import EXPLORATION_CONTEXT, GUIDED_TRACE_ID, guided_lineage
from tests.support.pool_store import pool_store_in_portal


def cli() -> typer.Typer:
    """The commands as the ``coevolve`` app registers them."""
    app = typer.Typer(add_completion=False)
    app.command("signals")(signals)
    app.add_typer(tasks_app, name="tasks")
    return app


def accepted_verdict(parent: Task) -> Verdict:
    lineage = guided_lineage(parent_task_id=parent.id)
    task = Task(
        id="synth-1",
        environment="bfcl",
        user_turns=["Create a folder named drafts here, please, right now."],
        initial_state=parent.initial_state,
        ground_truth=[[ToolCall(name="mkdir", arguments={"dir_name": "drafts"})]],
        env_config=parent.env_config,
        origin="synthesized",
        description="Create a folder.",
        lineage=lineage,
    )
    return Verdict(
        id="verdict-1",
        candidate_id=lineage.candidate_id,
        accepted=True,
        reasons=["all criteria hold"],
        task=task,
        criteria={"replay_succeeded": True, "api_matching": True},
    )


@pytest.fixture
def pool_file(settings: Settings) -> Path:
    return seeded_pool_file(
        settings, lambda store, parent: store.record_verdict(accepted_verdict(parent))
    )


invoke = invoker(cli)


def test_tasks_from_the_duckdb_file_when_no_pool_store_answers(
    settings: Settings, pool_file: Path
) -> None:
    code, out, err = invoke(settings, "tasks", "lineage", "synth-1", "--json")
    assert code == 0, err
    assert "no pool-store answering" in err
    chain = json.loads(out)
    assert chain["trace_id"] == GUIDED_TRACE_ID
    assert chain["signal"]["kind"] == "boundary" and chain["exploration"]["steps"] == 3
    assert chain["candidate"]["id"] == "cand-1" and chain["verdict"]["accepted"] is True
    assert chain["context"]["focus_pattern"] == EXPLORATION_CONTEXT.focus_pattern

    code, out, _ = invoke(settings, "tasks", "lineage", "synth-1")
    assert code == 0
    assert "signal       sig-1  boundary" in out and "verdict      verdict-1  accepted" in out
    assert f"trace        {GUIDED_TRACE_ID}" in out

    code, out, _ = invoke(settings, "tasks", "show", "synth-1")
    assert code == 0 and 'mkdir({"dir_name": "drafts"})' in out

    code, out, _ = invoke(settings, "tasks", "list", "--origin", "synthesized", "--json")
    listing = json.loads(out)
    assert listing["source"] == "duckdb newest"
    assert [t["id"] for t in listing["tasks"]] == ["synth-1"]
    assert listing["counts"]["synthesized"] == 1 and listing["counts"]["seed"] == 1

    code, _, err = invoke(settings, "tasks", "show", "nope")
    assert code == 1 and "no task 'nope'" in err


def test_tasks_through_a_running_pool_store(settings: Settings, pool_file: Path) -> None:
    settings.services["pool_store"] = {"feed_jobs": False}
    with pool_store_in_portal(settings):
        code, out, err = invoke(settings, "tasks", "lineage", "synth-1", "--json")
        assert code == 0, err
        assert "no pool-store answering" not in err
        assert json.loads(out)["verdict"]["id"] == "verdict-1"
        code, out, err = invoke(settings, "tasks", "list", "--json")
        assert code == 0, err
        listing = json.loads(out)
        assert listing["source"] == "pool-store sample"
        parent = filesystem_seed_tasks(1)[0]
        assert sorted(t["id"] for t in listing["tasks"]) == sorted(["synth-1", parent.id])


def test_signals_prints_what_is_published_while_it_listens(settings: Settings) -> None:
    task = filesystem_seed_tasks(1)[0]
    group = mixed_group(task)
    signal = Signal(
        id="sig-live",
        kind="boundary",
        task=task,
        trajectory=group.trajectories[1],
        group_id=group.id,
        policy_version=4,
        evidence={"successes": 2, "failures": 2},
    )
    other = msgspec.structs.replace(signal, id="sig-rare", kind="rare")
    cli_done = threading.Event()

    async def publish_until_the_cli_is_done() -> None:
        """Core publishes reach only current subscribers, and the CLI subscribes once its
        connection is up: publish until it has listened its time and returned."""
        bus = await Bus.connect(settings.bus, "publisher")
        try:
            await bus.ensure_streams()
            while not cli_done.is_set():
                await bus.publish_core(signal_subject("boundary"), signal)
                await bus.publish_core(signal_subject("rare"), other)
                await anyio.sleep(0.1)
        finally:
            await bus.close()

    publisher = threading.Thread(target=anyio.run, args=(publish_until_the_cli_is_done,))
    publisher.start()
    try:
        code, out, err = invoke(
            settings, "signals", "--kind", "boundary", "--seconds", "2.5", "--json"
        )
    finally:
        cli_done.set()
        publisher.join()
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert records and all(r["kind"] == "boundary" for r in records)
    assert records[0]["id"] == "sig-live" and records[0]["task_id"] == task.id
    assert records[0]["evidence"] == {"successes": 2, "failures": 2}
    assert f"{len(records)} signal(s) on coevolve.signals.boundary" in err

    code, _, err = invoke(settings, "signals", "--kind", "sideways", "--seconds", "0.1")
    assert code != 0 and "unknown kind" in err
