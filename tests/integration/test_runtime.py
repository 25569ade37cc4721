"""The actor runtime against a real nats-server: redelivery, dead letters, traces, drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider

from coevolve.shared.config import Settings
from coevolve.shared.messages import (
    DeadLetter,
    Exploration,
    ExplorationRequest,
    Task,
    TaskCandidate,
    decode,
    derived_id,
)
from coevolve.shared.runtime.actor import (
    STOP_AFTER_DRAIN_S,
    Actor,
    ActorRunner,
    Consumer,
    Delivery,
)
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import (
    ABSTRACTOR_CONSUMER,
    CANDIDATES,
    EXPLORATION_REQUESTS,
    EXPLORATIONS,
    EXPLORER_REQUESTS_CONSUMER,
    dead_letter_subject,
)
from coevolve.shared.runtime.telemetry import read_spans
from tests.integration.probe import PROBE_CONSUMER, Blocking, ProbeActor
from tests.support.wait import wait_until, wait_until_sync

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def candidate(name: str) -> TaskCandidate:
    task = Task(id=f"task-{name}", environment="bfcl", user_turns=[f"do {name}"])
    return TaskCandidate(id=f"cand-{name}", exploration_id="x", task=task)


def record_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def start_probe(
    settings: Settings, record: Path, sleep_s: float, *, blocking: Blocking = ""
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "NATS_URL": settings.bus.url,
        "COEVOLVE_RUN_DIR": str(settings.run_dir),
        "PROBE_RECORD": str(record),
        "PROBE_SLEEP_S": str(sleep_s),
        "PROBE_BLOCKING": blocking,
    }
    # its log (stderr) next to the record, for tests that read how it stopped
    with record.with_suffix(".log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.integration.probe"], cwd=ROOT, env=env, stderr=log
        )


async def connect(settings: Settings) -> Bus:
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    return bus


async def test_killed_before_ack_is_redelivered_but_not_after_ack(
    settings: Settings, tmp_path: Path
) -> None:
    record = tmp_path / "record.txt"
    bus = await connect(settings)
    probe = start_probe(settings, record, sleep_s=30)
    try:
        await bus.publish(CANDIDATES, candidate("a"))
        await wait_until(lambda: "start cand-a 1" in record_lines(record), 60, "probe took a")
        probe.kill()  # SIGKILL in the middle of the handler: no ack was sent
        probe.wait(5)
        probe = start_probe(settings, record, sleep_s=0)
        await wait_until(lambda: "done cand-a" in record_lines(record), 60, "a redelivered")
        assert "start cand-a 2" in record_lines(record)

        await bus.publish(CANDIDATES, candidate("b"))
        await wait_until(lambda: "done cand-b" in record_lines(record), 60, "b handled")

        async def acked() -> bool:
            info = await bus.js.consumer_info(PROBE_CONSUMER.stream, PROBE_CONSUMER.durable)
            return int(info.num_ack_pending) == 0

        await wait_until(acked, 60, "the ack of b to reach the server", poll_s=0.05)
        probe.kill()
        probe.wait(5)
        probe = start_probe(settings, record, sleep_s=0)
        await bus.publish(CANDIDATES, candidate("c"))  # handled once the new probe consumes
        await wait_until(lambda: "done cand-c" in record_lines(record), 60, "c handled")
        await anyio.sleep(2 * PROBE_CONSUMER.ack_wait_s)  # room for a wrongful redelivery of b
        assert [line for line in record_lines(record) if "cand-b" in line] == [
            "start cand-b 1",
            "done cand-b",
        ]
    finally:
        probe.kill()
        probe.wait(5)
        await bus.close()


async def test_undecodable_bytes_go_to_dead_letters_and_service_stays_alive(
    settings: Settings, tmp_path: Path
) -> None:
    record = tmp_path / "record.txt"
    actor = ProbeActor(settings, record=record)
    runner = ActorRunner(actor)
    bus = await connect(settings)
    letters = await bus.nc.subscribe(dead_letter_subject("probe"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runner.run(handle_signals=False))
        await bus.js.publish(CANDIDATES, b"\x93not msgpack of a candidate", timeout=5)
        raw = await letters.next_msg(timeout=10)
        letter = decode(raw.data, DeadLetter)
        assert letter.subject == CANDIDATES
        assert "TaskCandidate" in letter.reason
        assert letter.payload == b"\x93not msgpack of a candidate"

        await bus.publish(CANDIDATES, candidate("after"))
        await wait_until(lambda: "cand-after" in actor.handled, 60, "still consuming")
        assert runner.stats.dead_lettered == 1
        runner.request_stop()
    await bus.close()


async def test_duplicate_publish_is_dropped_by_jetstream(
    settings: Settings, tmp_path: Path
) -> None:
    actor = ProbeActor(settings, record=tmp_path / "record.txt")
    runner = ActorRunner(actor)
    bus = await connect(settings)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runner.run(handle_signals=False))
        first = await bus.publish(CANDIDATES, candidate("dup"))
        second = await bus.publish(CANDIDATES, candidate("dup"))
        assert second.duplicate and not first.duplicate
        await wait_until(lambda: "cand-dup" in actor.handled, 60, "handled")
        await anyio.sleep(1)
        assert actor.handled.count("cand-dup") == 1
        runner.request_stop()
    await bus.close()


class Hop(Actor):
    """One hop of a chain: consume, then republish downstream (or stop)."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        consumer: Consumer[Any],
    ) -> None:
        super().__init__(settings)
        self.name = name  # type: ignore[misc]
        self._consumer = consumer

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (self._consumer,)


async def test_three_hop_chain_is_one_trace(settings: Settings, tmp_path: Path) -> None:
    done: list[str] = []
    hops: list[Hop] = []

    async def explore(request: ExplorationRequest, _: Delivery) -> None:
        out = Exploration(
            id=derived_id("exp", request.id), mode="unguided", task=request.task, rounds=[]
        )
        await hops[0].publish(EXPLORATIONS, out)

    async def abstract(exploration: Exploration, _: Delivery) -> None:
        out = TaskCandidate(
            id=derived_id("cand", exploration.id),
            exploration_id=exploration.id,
            task=exploration.task,
        )
        await hops[1].publish(CANDIDATES, out)

    async def judge(cand: TaskCandidate, _: Delivery) -> None:
        done.append(cand.id)

    hops += [
        Hop(
            settings,
            "hop_explorer",
            Consumer(EXPLORER_REQUESTS_CONSUMER, ExplorationRequest, explore),
        ),
        Hop(settings, "hop_abstractor", Consumer(ABSTRACTOR_CONSUMER, Exploration, abstract)),
        Hop(settings, "hop_judge", Consumer(PROBE_CONSUMER, TaskCandidate, judge)),
    ]
    runners = [ActorRunner(hop) for hop in hops]
    bus = await connect(settings)
    origin = TracerProvider().get_tracer("test")
    async with anyio.create_task_group() as tg:
        for runner in runners:
            tg.start_soon(lambda r=runner: r.run(handle_signals=False))
        with origin.start_as_current_span("test origin") as root:
            task = Task(id="t", environment="bfcl", user_turns=["go"])
            await bus.publish(EXPLORATION_REQUESTS, ExplorationRequest(task=task))
        await wait_until(lambda: len(done) == 1, 60, "chain completed")
        for runner in runners:
            runner.request_stop()
    await bus.close()

    spans = [s for s in read_spans(settings.run_dir / "traces") if " process " in s["name"]]
    services = {s["service"] for s in spans}
    assert services == {"hop_explorer", "hop_abstractor", "hop_judge"}
    trace_ids = {s["trace_id"] for s in spans}
    assert trace_ids == {format(root.get_span_context().trace_id, "032x")}


def test_sigterm_drains_in_flight_work_and_exits_zero(settings: Settings, tmp_path: Path) -> None:
    record = tmp_path / "record.txt"

    async def publish() -> None:
        bus = await connect(settings)
        await bus.publish(CANDIDATES, candidate("slow"))
        await bus.close()

    probe = start_probe(settings, record, sleep_s=2)
    try:
        anyio.run(publish)
        wait_until_sync(lambda: "start cand-slow 1" in record_lines(record), 60, "slow taken")
        probe.send_signal(signal.SIGTERM)
        assert probe.wait(60) == 0  # stopped by itself, not killed
        assert "done cand-slow" in record_lines(record)  # the in-flight handler finished
        log = record.with_suffix(".log").read_text()
        assert "stopped" in log
        assert "Traceback" not in log, log
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()


@contextmanager
def probe_stopped_mid_work(
    settings: Settings, record: Path, name: str, blocking: Blocking
) -> Iterator[subprocess.Popen[bytes]]:
    """A probe sent SIGTERM while its handler blocks a thread for 120 s (``blocking``)."""

    async def publish() -> None:
        bus = await connect(settings)
        await bus.publish(CANDIDATES, candidate(name))
        await bus.close()

    probe = start_probe(settings, record, sleep_s=120, blocking=blocking)
    try:
        anyio.run(publish)
        wait_until_sync(lambda: f"start cand-{name} 1" in record_lines(record), 60, f"{name} taken")
        probe.send_signal(signal.SIGTERM)
        yield probe
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()


def test_sigterm_exits_within_the_drain_past_a_thread_still_busy(
    settings: Settings, tmp_path: Path
) -> None:
    """Work blocking a worker thread (a training step) does not hold the exit."""
    record = tmp_path / "record.txt"
    with probe_stopped_mid_work(settings, record, "busy", "worker") as probe:
        assert probe.wait(90) == 0  # well before the 120 s of blocked work would end
        assert "done cand-busy" not in record_lines(record)
        assert "abandoned work" in record.with_suffix(".log").read_text()


def test_an_exit_held_after_stopping_ends_with_every_stack_in_the_log(
    settings: Settings, tmp_path: Path
) -> None:
    """The event loop's close waits for its default executor (Python 3.11, no limit): a
    thread busy there must not hold the process past the time ``up`` gives a stop."""
    record = tmp_path / "record.txt"
    with probe_stopped_mid_work(settings, record, "held", "executor") as probe:
        # within the drain and the limits after it, as up allows, plus a start-up's slack
        assert probe.wait(settings.runtime.drain_timeout_s + STOP_AFTER_DRAIN_S + 5) == 1
        log = record.with_suffix(".log").read_text()
        stopped_at = log.index("stopped")
        assert "most recent call first" in log[stopped_at:]
        # the stacks name what held it: the loop's close joining its default executor
        assert "in _do_shutdown" in log[stopped_at:], log[stopped_at:]


def test_sigterm_naks_work_that_outlives_the_drain(settings: Settings, tmp_path: Path) -> None:
    record = tmp_path / "record.txt"

    async def publish_then_check(check: bool) -> int:
        bus = await connect(settings)
        try:
            if not check:
                await bus.publish(CANDIDATES, candidate("long"))
                return 0
            info = await bus.js.consumer_info("COEVOLVE_CANDIDATES", "probe")
            return int(info.num_ack_pending) + int(info.num_pending)
        finally:
            await bus.close()

    probe = start_probe(settings, record, sleep_s=60)
    try:
        anyio.run(publish_then_check, False)
        wait_until_sync(lambda: "start cand-long 1" in record_lines(record), 60, "long taken")
        probe.send_signal(signal.SIGTERM)
        assert probe.wait(50) == 0  # after its drain, before the 60 s handler would end
        assert "done cand-long" not in record_lines(record)
        # nak'd, not lost: the message is waiting for the next consumer
        assert anyio.run(publish_then_check, True) == 1
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
