"""DuckDB under kill -9: pool-store (a real `coevolve serve pool_store` process on a real
nats-server) is SIGKILLed during a burst of verdict writes, then restarted. The file must
open, no task may be half-written, and every verdict the broker acknowledged must end up
in DuckDB exactly once (with the task-added event of every task it added)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path

import duckdb
import nats.errors

from coevolve.bench.flood import write_bare_pool_config
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import BusSettings
from coevolve.shared.messages import Lineage, Task, TaskAdded, Verdict, decode
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import POOL_VERDICTS_CONSUMER, VERDICTS
from tests.support.wait import wait_until

VERDICTS_SENT = 200
ACK_WAIT_S = 2.0
# The real service, with one change: what the killed instance held comes back after
# ACK_WAIT_S instead of the production 60 s, so the test does not sit idle for a minute.
SERVE = f"""
import dataclasses, sys
import coevolve.services.pool_store.actor as a
a.POOL_VERDICTS_CONSUMER = dataclasses.replace(a.POOL_VERDICTS_CONSUMER, ack_wait_s={ACK_WAIT_S})
from coevolve.cli import main
sys.argv = ["coevolve", "serve", "pool_store", *sys.argv[1:]]
main()
"""


def verdict(i: int) -> Verdict:
    task = Task(
        id=f"synth-{i}",
        environment="bfcl",
        user_turns=[f"create the folder report-{i} and move notes.txt into it"],
        initial_state={"root": {"notes.txt": f"note {i}"}},
        origin="synthesized",
        lineage=Lineage(signal_id=f"signal-{i}", exploration_id=f"exploration-{i}"),
    )
    return Verdict(
        id=f"verdict-{i}",
        candidate_id=f"candidate-{i}",
        accepted=i % 3 != 0,
        reasons=["replays"] if i % 3 else ["final state differs"],
        task=task,
    )


def start_pool_store(run_dir: Path, config: Path, url: str) -> subprocess.Popen[bytes]:
    log = (run_dir / "pool_store.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "--run-dir", str(run_dir), "--config", str(config)],
        env={**os.environ, "NATS_URL": url},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


async def recorded(pool: PoolClient) -> int:
    try:
        stats = await pool.stats()
    except (nats.errors.Error, TimeoutError):
        return -1  # pool-store is down
    return stats.accepted_candidates + stats.rejected_candidates


def test_kill_9_during_a_verdict_burst_loses_nothing(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = write_bare_pool_config(run_dir / "config.yaml")
    processes = [start_pool_store(run_dir, config, nats_server.url)]
    try:
        acked, recorded_at_kill, added_events = asyncio.run(
            burst_kill_and_restart(run_dir, config, nats_server.url, processes)
        )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert 0 < recorded_at_kill < VERDICTS_SENT  # it died in the middle of the burst
    assert len(acked) == VERDICTS_SENT

    # the file opens (read-only, no writer left) and holds every acknowledged verdict once
    with duckdb.connect(str(run_dir / "pool.duckdb"), read_only=True) as db:
        ids = [row[0] for row in db.execute("SELECT id FROM verdicts").fetchall()]
        assert sorted(ids) == sorted(acked)
        tasks = {
            row[0]: row[1:]
            for row in db.execute(
                "SELECT id, user_turns, initial_state, lineage, content_hash FROM tasks"
            ).fetchall()
        }
        added = db.execute(
            "SELECT id, pool_task_id, task FROM verdicts WHERE added ORDER BY id"
        ).fetchall()
    accepted = [f"verdict-{i}" for i in range(VERDICTS_SENT) if i % 3 != 0]
    assert sorted(v for v, _, _ in added) == sorted(accepted)
    # no task half-written: one row per added task, whole, pointing back at its verdict
    assert sorted(tasks) == sorted(pool_task_id for _, pool_task_id, _ in added)
    for verdict_id, task_id, task_json in added:
        user_turns, initial_state, lineage, content_hash = tasks[task_id]
        expected = verdict(int(verdict_id.removeprefix("verdict-"))).task
        assert json.loads(user_turns) == expected.user_turns
        assert json.loads(initial_state) == expected.initial_state
        assert json.loads(lineage)["verdict_id"] == verdict_id
        assert content_hash == expected.content_hash()
        assert json.loads(task_json)["id"] == task_id
    # every added task was announced, once
    assert sorted(added_events) == sorted(tasks)
    # and pool-store itself opens the file again
    with PoolStore(run_dir / "pool.duckdb") as store:
        assert store.stats().accepted_candidates == len(accepted)


async def burst_kill_and_restart(
    run_dir: Path, config: Path, url: str, processes: list[subprocess.Popen[bytes]]
) -> tuple[list[str], int, list[str]]:
    """Publish the burst, SIGKILL pool-store a fifth of the way in, restart it, wait for
    it to catch up; (acknowledged verdict ids, verdicts recorded at the kill, task-added
    event task ids)."""
    bus = await Bus.connect(BusSettings(url=url), "kill9-test")
    pool = PoolClient(bus, timeout_s=2.0)
    try:
        await wait_until(lambda: _ge(recorded(pool), 0), 60, "pool-store", poll_s=0.05)
        acked: list[str] = []

        async def publish_all() -> None:
            for start in range(0, VERDICTS_SENT, 10):
                batch = [verdict(i) for i in range(start, start + 10)]
                await asyncio.gather(*(bus.publish(VERDICTS, v) for v in batch))
                acked.extend(v.id for v in batch)  # the broker stored them all

        publisher = asyncio.create_task(publish_all())
        await wait_until(
            lambda: _ge(recorded(pool), VERDICTS_SENT // 5), 60, "a fifth of the burst", poll_s=0.05
        )
        recorded_at_kill = await recorded(pool)
        processes[0].send_signal(signal.SIGKILL)
        processes[0].wait()
        await publisher  # the rest of the burst lands while pool-store is dead
        restarted = start_pool_store(run_dir, config, url)
        processes.append(restarted)

        async def all_in() -> bool:
            if await recorded(pool) != len(acked):
                return False
            info = await bus.js.consumer_info(
                POOL_VERDICTS_CONSUMER.stream, POOL_VERDICTS_CONSUMER.durable
            )
            return info.num_pending == 0 and info.num_ack_pending == 0

        await wait_until(all_in, 90, "every acknowledged verdict recorded", poll_s=0.05)
        await asyncio.sleep(ACK_WAIT_S + 0.5)  # a redelivery would show up as a duplicate now
        assert await recorded(pool) == len(acked)
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(20) == 0
        return acked, recorded_at_kill, await task_added_events(bus)
    finally:
        await bus.close()


async def _ge(value: Awaitable[int], bound: int) -> bool:
    return await value >= bound


async def task_added_events(bus: Bus) -> list[str]:
    info = await bus.js.stream_info("COEVOLVE_TASK_EVENTS")
    events = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg("COEVOLVE_TASK_EVENTS", seq)
        events.append(decode(raw.data or b"", TaskAdded).task_id)
    return events
