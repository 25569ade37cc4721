"""The data-loop benchmark's parts, without `coevolve up` or a model: counting real bus
traffic, summarizing a real pool file, stopping a child process group."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from coevolve.bench.dataloop import (
    LoopCounter,
    bench_minutes,
    policy_versions,
    pool_summary,
    summarize,
    until_signalled,
    watch_bus,
)
from coevolve.processes import (
    kill_leftovers,
    share_model_cache,
    stop_process_group,
    wait_for_nats_url,
)
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import BusSettings
from coevolve.shared.messages import (
    Exploration,
    Heartbeat,
    Lineage,
    Origin,
    PolicyVersion,
    Signal,
    SignalKind,
    Task,
    TaskCandidate,
    ToolCall,
    Verdict,
)
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import (
    CANDIDATES,
    EXPLORATIONS,
    POLICY_BUCKET,
    POLICY_UPDATES,
    VERDICTS,
    heartbeat_subject,
    signal_subject,
)
from tests.support.messages import untokenized_trajectory
from tests.support.wait import wait_until_sync


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_task(number: int, origin: Origin = "seed", signal_kind: SignalKind | None = None) -> Task:
    signal_id = f"signal-{number}" if signal_kind else None
    return Task(
        id=f"task-{number}",
        environment="bfcl",
        user_turns=[f"What is {number} plus 2?"],
        ground_truth=[[ToolCall(name="add", arguments={"a": number, "b": 2})]],
        env_config={"involved_classes": ["MathAPI"]},
        origin=origin,
        lineage=Lineage(signal_kind=signal_kind, signal_id=signal_id),
    )


def verdict(
    number: int, accepted: bool, reason: str, signal_kind: SignalKind = "boundary"
) -> Verdict:
    return Verdict(
        id=f"verdict-{number}",
        candidate_id=f"candidate-{number}",
        accepted=accepted,
        reasons=[reason],
        task=make_task(number, "synthesized", signal_kind),
    )


# ---------------------------------------------------------------------- counting the bus


async def publish_data_loop(url: str) -> None:
    bus = await Bus.connect(BusSettings(url=url), name="test-publisher")
    try:
        await bus.ensure_streams()
        trajectory = untokenized_trajectory("trajectory-1", "task-1")
        kinds: tuple[SignalKind, ...] = ("boundary", "boundary", "rare")
        for index, kind in enumerate(kinds):
            signal_message = Signal(
                kind=kind,
                task=make_task(index),
                trajectory=trajectory,
                group_id=f"group-{index}",
                policy_version=0,
            )
            await bus.publish(signal_subject(kind), signal_message)
        exploration = Exploration(mode="guided", task=make_task(1), rounds=[])
        await bus.publish(EXPLORATIONS, exploration)
        await bus.publish(
            CANDIDATES, TaskCandidate(exploration_id=exploration.id, task=make_task(7))
        )
        first = verdict(1, True, "ok")
        await bus.publish(VERDICTS, first)
        await bus.publish(VERDICTS, verdict(2, False, "final result differs"))
        await bus.publish(VERDICTS, first)  # a re-publish after a crash: same Nats-Msg-Id
        update = PolicyVersion(
            version=3, step=3, bucket=POLICY_BUCKET, object_name="v3", base_model="m"
        )
        await bus.publish(POLICY_UPDATES, update)
        beat = Heartbeat(service="judge", instance="a", pid=1, host="h", started_at=0.0)
        await bus.publish_core(heartbeat_subject("judge"), beat)
        await bus.nc.flush()
    finally:
        await bus.close()


@pytest.mark.anyio
async def test_counts_families_signal_kinds_and_verdicts_on_a_real_bus(
    nats_server: NatsServer,
) -> None:
    counter = LoopCounter()
    async with anyio.create_task_group() as tg:
        await tg.start(watch_bus, BusSettings(url=nats_server.url), counter, 60.0)
        await publish_data_loop(nats_server.url)
        with anyio.fail_after(10):
            while counter.counts["heartbeats"] < 1:
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()

    assert counter.counts["signals"] == 3
    assert dict(counter.signals_by_kind) == {"boundary": 2, "rare": 1}
    assert counter.counts["explorations"] == 1
    assert counter.counts["candidates"] == 1
    assert counter.counts["verdicts"] == 2
    assert dict(counter.verdicts) == {"accepted": 1, "rejected": 1}
    assert counter.duplicates == 1
    assert counter.policy_version == 3
    assert set(counter.services_running_s) == {"judge"}
    first = counter.first_seen_s
    assert first["signals"] <= first["explorations"] <= first["verdicts"]
    assert {"signals.boundary", "signals.rare", "accepted_verdict"} <= set(first)

    summary = summarize(counter, None, [], minutes=1.0)
    assert summary["counts"]["signals"] == 3
    assert summary["counts"]["rollout_groups"] == 0
    assert summary["acceptance_rate"] == 0.5  # from the live verdicts: no pool file
    assert summary["other_counts"] == {"heartbeats": 1}


def test_watch_bus_stops_at_its_duration(nats_server: NatsServer) -> None:
    counter = LoopCounter()
    started = time.monotonic()
    anyio.run(watch_bus, BusSettings(url=nats_server.url), counter, 1.0)
    assert time.monotonic() - started >= 0.9  # it watched for its duration, then returned


def test_seed_explorations_are_published_and_counted(nats_server: NatsServer) -> None:
    counter = LoopCounter()
    anyio.run(
        functools.partial(
            watch_bus, BusSettings(url=nats_server.url), counter, 1.5, seed_explorations=2
        )
    )
    # the subscription was live before the requests went out: it saw both
    assert counter.counts["exploration_requests"] == 2


# ---------------------------------------------------------------------- the pool's outcome


def test_pool_summary_reads_origins_verdicts_and_reasons(tmp_path: Path) -> None:
    db_path = tmp_path / "pool.duckdb"
    with PoolStore(db_path) as store:
        store.add_tasks([make_task(number) for number in range(4)])
        store.record_verdict(verdict(10, True, "replays", "boundary"))
        store.record_verdict(verdict(11, True, "replays", "rare"))
        store.record_verdict(verdict(12, False, "final result differs", "boundary"))
        store.record_verdict(verdict(13, False, "final result differs", "rare"))
        store.record_verdict(verdict(14, False, "unanswerable turn", "rare"))

    summary = pool_summary(db_path)

    assert summary["tasks_by_origin"] == {"seed": 4, "explored": 0, "synthesized": 2}
    assert summary["growth"] == 2
    assert summary["verdicts"] == {"accepted": 2, "rejected": 3, "accepted_and_new": 2}
    assert summary["acceptance_rate"] == 0.4
    assert summary["top_rejection_reasons"] == [
        ["final result differs", 2],
        ["unanswerable turn", 1],
    ]
    assert summary["verdicts_by_signal_kind"] == {
        "boundary": {"accepted": 1, "verdicts": 2},
        "rare": {"accepted": 1, "verdicts": 3},
    }
    result = summarize(LoopCounter(), summary, [1, 2], minutes=3.0)
    assert result["pool"] == {"seed": 4, "explored": 0, "synthesized": 2, "growth": 2}
    assert result["acceptance_rate"] == 0.4
    assert result["policy"]["files"] == 2


def test_policy_versions_come_from_the_weight_files(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    for name in ("v2.safetensors", "v10.safetensors", "v3.tmp", "notes.txt"):
        (policies / name).write_bytes(b"x")
    assert policy_versions(tmp_path) == [2, 10]
    assert policy_versions(tmp_path / "missing") == []


def test_minutes_come_from_the_environment_override() -> None:
    assert bench_minutes(quick=False, env={}) == 20.0
    assert bench_minutes(quick=True, env={}) == 3.0
    assert bench_minutes(quick=True, env={"COEVOLVE_BENCH_MINUTES": "0.5"}) == 0.5
    with pytest.raises(ValueError):
        bench_minutes(quick=False, env={"COEVOLVE_BENCH_MINUTES": "0"})


# ---------------------------------------------------------------------- stopping processes

STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"])
print(grandchild.pid, flush=True)
time.sleep(120)
"""

# SIGINT's default handler restored: a shell starts background jobs with SIGINT ignored,
# and a child inherits that (so does a test run launched with `&`)
OBEDIENT = (
    "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "print('ready', flush=True); time.sleep(120)"
)


def start_child(code: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    child = subprocess.Popen(
        [sys.executable, "-c", code, *extra], stdout=subprocess.PIPE, start_new_session=True
    )
    assert child.stdout is not None
    first_line = child.stdout.readline().decode().strip()  # handlers are installed by now
    return child, first_line


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for a reaper we do not control."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def test_a_group_that_ignores_sigint_is_killed_after_the_grace_period() -> None:
    child, grandchild_line = start_child(STUBBORN)
    grandchild = int(grandchild_line)
    try:
        started = time.monotonic()
        shutdown = stop_process_group(child, grace_s=1.0)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert not shutdown.graceful
    assert shutdown.returncode == -signal.SIGKILL
    assert took >= 1.0  # the grace period came first
    wait_until_sync(lambda: gone(grandchild), 60, "the grandchild to exit")


def test_a_child_that_handles_sigint_stops_gracefully() -> None:
    child, ready = start_child(OBEDIENT)
    assert ready == "ready"
    shutdown = stop_process_group(child, grace_s=10.0)
    assert shutdown.graceful  # it exited within its grace period, not killed
    assert shutdown.returncode != 0  # KeyboardInterrupt


def test_leftovers_are_found_by_the_run_directory_in_their_command_line(tmp_path: Path) -> None:
    marker = str(tmp_path / "run")
    ours, _ = start_child(OBEDIENT, "--run-dir", marker)
    other, _ = start_child(OBEDIENT, "--run-dir", str(tmp_path / "other"))
    try:
        killed = kill_leftovers(marker)
        assert killed == [ours.pid]
        assert ours.wait(5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for child in (ours, other):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def test_the_nats_url_is_read_from_up_json_once_written(tmp_path: Path) -> None:
    writer = (
        "import json, pathlib, sys, time; time.sleep(0.3); "
        "pathlib.Path(sys.argv[1]).write_text(json.dumps({'nats_url': 'nats://127.0.0.1:4999'})); "
        "time.sleep(120)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", writer, str(tmp_path / "up.json")], start_new_session=True
    )
    try:
        assert wait_for_nats_url(tmp_path, child, timeout_s=10) == "nats://127.0.0.1:4999"
    finally:
        stop_process_group(child, grace_s=5)


def test_an_up_that_exits_before_nats_is_reported(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_for_nats_url(tmp_path, child, timeout_s=10)


def test_the_model_cache_of_the_base_run_is_linked_not_copied(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "models" / "SmolLM2").mkdir(parents=True)
    run_dir = tmp_path / "bench" / "run"
    assert share_model_cache(run_dir, base)
    assert (run_dir / "models" / "SmolLM2").is_dir()
    assert (run_dir / "models").resolve() == (base / "models").resolve()
    assert not share_model_cache(tmp_path / "other", tmp_path / "no-models")


def test_a_signal_ends_the_watch_early_and_is_reported() -> None:
    finished: list[bool] = []

    async def long_watch() -> None:
        await anyio.sleep(30)
        finished.append(True)

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        received = anyio.run(until_signalled, long_watch)
    finally:
        timer.cancel()
    assert received == signal.SIGINT and not finished  # ended before its 30 s watch


def test_without_a_signal_the_watch_runs_to_its_end() -> None:
    async def short_watch() -> None:
        await anyio.sleep(0.1)

    assert anyio.run(until_signalled, short_watch) is None
