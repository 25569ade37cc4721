"""The event lines of `coevolve up`, from real messages on a real nats-server."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from coevolve.cli.events import (
    EventPrinter,
    EventTracker,
    EventWatcherThread,
    watch_events,
)
from coevolve.shared.config import Settings
from coevolve.shared.messages import (
    GRPO_STEP_PHASE,
    Heartbeat,
    Metric,
    Signal,
    Task,
    TaskAdded,
    Verdict,
    encode,
)
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import (
    POLICY_UPDATES,
    TASK_ADDED,
    VERDICTS,
    heartbeat_subject,
    metrics_subject,
    signal_subject,
)
from tests.support.messages import heartbeat, policy_version, untokenized_trajectory
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.anyio
STAMP = r"\d\d:\d\d:\d\d  "


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def task(task_id: str) -> Task:
    return Task(id=task_id, environment="bfcl", user_turns=["list the files"])


def signal(kind: str, task_id: str) -> Signal:
    trajectory = untokenized_trajectory("traj-1", task_id, policy_version=3)
    return Signal(
        kind=kind,  # type: ignore[arg-type]
        task=task(task_id),
        trajectory=trajectory,
        group_id="g-1",
        policy_version=3,
    )


def learner_heartbeat(phase: str, done: int | None = None, total: int | None = None) -> Heartbeat:
    return heartbeat("learner", phase, progress_done=done, progress_total=total)


def matching_line(lines: list[str], pattern: str) -> str | None:
    return next((line for line in lines if re.fullmatch(STAMP + pattern, line)), None)


async def wait_for_line(lines: list[str], pattern: str, timeout: float = 30.0) -> str:
    # generous: a loaded 2-core CI box once took over 10 s for one of these lines
    with anyio.move_on_after(timeout):
        while (line := matching_line(lines, pattern)) is None:
            await anyio.sleep(0.05)
        return line
    # a stalled event loop wakes with its deadline passed: let the watcher's pending
    # messages through before judging, so a stall is not read as a lost message
    await anyio.sleep(0.5)
    if (line := matching_line(lines, pattern)) is not None:
        return line
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s; lines: {lines}")


class Watching:
    """A watcher on the test's NATS, writing into ``lines``."""

    def __init__(self, url: str, join_timeout_s: float = 20.0) -> None:
        self.lines: list[str] = []
        printer = EventPrinter(self.lines.append)
        self.tracker = EventTracker(printer, join_timeout_s=join_timeout_s)
        self.url = url

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        await tg.start(
            lambda task_status: watch_events(self.url, self.tracker, task_status=task_status)
        )


async def connect(settings: Settings) -> Bus:
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    return bus


@asynccontextmanager
async def watched(
    settings: Settings, join_timeout_s: float = 20.0
) -> AsyncIterator[tuple[Bus, Watching]]:
    """A bus to publish on and a watcher of it, both stopped on leaving."""
    bus = await connect(settings)
    watching = Watching(settings.bus.url, join_timeout_s)
    try:
        async with anyio.create_task_group() as tg:
            await watching.start(tg)
            yield bus, watching
            tg.cancel_scope.cancel()
    finally:
        await bus.close()


async def test_policy_signal_verdict_and_progress_lines(settings: Settings) -> None:
    async with watched(settings) as (bus, watching):
        lines = watching.lines
        await bus.publish_core(heartbeat_subject("learner"), learner_heartbeat("starting"))
        await bus.publish_core(heartbeat_subject("learner"), learner_heartbeat("warm start", 7, 16))
        await wait_for_line(lines, r"learner\s+warm start 7/16")

        # the announcement comes first, the step's metrics just after (as the learner does)
        await bus.publish(POLICY_UPDATES, policy_version(3, 2))
        metrics = {"reward_mean": 0.42, "kl": 0.0012, "staleness_mean": 0.8, "loss": 1.0}
        for name, value in metrics.items():
            metric = Metric(service="learner", name=name, value=value, step=2)
            await bus.publish_core(metrics_subject("learner"), metric)
        await wait_for_line(lines, r"learner\s+policy v3  reward 0.42  kl 0\.0012  staleness 0\.8")

        await bus.publish(signal_subject("boundary"), signal("boundary", "bfcl-7"))
        await wait_for_line(lines, r"signal_monitor\s+signal boundary  task bfcl-7  policy v3")

        rejected = Verdict(
            candidate_id="c1",
            accepted=False,
            reasons=["replay failed", "too close to seed"],
            task=task("cand-1"),
        )
        await bus.publish(VERDICTS, rejected)
        await wait_for_line(
            lines, r"judge\s+rejected task cand-1: replay failed; too close to seed"
        )
        accepted = Verdict(candidate_id="c2", accepted=True, reasons=[], task=task("cand-2"))
        await bus.publish(VERDICTS, accepted)
        await wait_for_line(lines, r"judge\s+accepted task cand-2")
        await bus.publish(TASK_ADDED, TaskAdded(task_id="cand-2", origin="synthesized"))
        await wait_for_line(lines, r"pool_store\s+task added cand-2 \(synthesized\)")
    assert not any("starting" in line for line in lines), lines
    assert watching.tracker.bad_messages == 0


async def test_bad_bytes_on_watched_subjects_do_not_stop_the_watcher(settings: Settings) -> None:
    async with watched(settings) as (bus, watching):
        for subject in (signal_subject("rare"), VERDICTS, heartbeat_subject("rollout")):
            await bus.nc.publish(subject, b"\x93not a message")
        # a valid message of another type: it decodes, but not as what the subject carries
        wrong_kind = TaskAdded(task_id="x", origin="seed")
        await bus.nc.publish(POLICY_UPDATES, encode(wrong_kind))
        await bus.publish(signal_subject("rare"), signal("rare", "bfcl-9"))
        await wait_for_line(watching.lines, r"signal_monitor\s+signal rare  task bfcl-9  policy v3")
        assert watching.tracker.bad_messages == 4


async def test_a_retried_publish_prints_one_line(settings: Settings) -> None:
    """A publish retried after a full stream reaches core subscribers twice, with one id."""
    async with watched(settings) as (bus, watching):
        rejected = Verdict(
            candidate_id="c1", accepted=False, reasons=["no call"], task=task("cand-1")
        )
        await bus.publish(VERDICTS, rejected)
        await bus.publish(VERDICTS, rejected)  # the same message id: a retry
        accepted = Verdict(candidate_id="c2", accepted=True, reasons=[], task=task("cand-2"))
        await bus.publish(VERDICTS, accepted)
        await wait_for_line(watching.lines, r"judge\s+accepted task cand-2")
    assert sum("rejected task cand-1" in line for line in watching.lines) == 1, watching.lines


async def test_policy_line_without_metrics_comes_after_the_join_timeout(
    settings: Settings,
) -> None:
    async with watched(settings, join_timeout_s=0.5) as (bus, watching):
        await bus.publish(POLICY_UPDATES, policy_version(1, 0))
        await wait_for_line(watching.lines, r"learner\s+policy v1  warm start")
        published = time.monotonic()
        await bus.publish(POLICY_UPDATES, policy_version(5, 4))
        await wait_for_line(watching.lines, r"learner\s+policy v5  reward -  kl -  staleness -")
        assert time.monotonic() - published >= 0.5  # held for the join timeout first


async def test_the_watcher_follows_a_nats_restart(
    settings: Settings, nats_server: NatsServer
) -> None:
    watching = Watching(settings.bus.url)
    async with anyio.create_task_group() as tg:
        await watching.start(tg)
        nats_server.stop()
        nats_server.start()  # same port, same store
        bus = await connect(settings)
        try:
            with anyio.fail_after(15):
                # the watcher resubscribes a moment after its reconnect: publish until seen
                while not any("bfcl-after" in line for line in watching.lines):
                    await bus.publish_core(signal_subject("rare"), signal("rare", "bfcl-after"))
                    await anyio.sleep(0.3)
        finally:
            await bus.close()
        tg.cancel_scope.cancel()


def test_progress_lines_are_throttled_but_a_new_phase_prints_at_once() -> None:
    clock = [0.0]
    lines: list[str] = []
    tracker = EventTracker(
        EventPrinter(lines.append), progress_every_s=5.0, monotonic=lambda: clock[0]
    )

    def beat(phase: str, done: int | None = None, at: float = 0.0) -> None:
        clock[0] = at
        tracker.on_message(heartbeat_subject("learner"), encode(learner_heartbeat(phase, done, 16)))

    beat("warm start", 0, at=0.0)
    beat("warm start", 1, at=1.0)  # too soon
    beat("warm start", 1, at=2.0)
    beat("warm start", 2, at=5.5)
    beat("warm start", 2, at=6.0)  # no change
    beat("running", at=6.5)  # a new phase does not wait
    beat(GRPO_STEP_PHASE, at=7.0)  # a step and the return from it: the policy line says it
    beat("running", at=8.0)
    beat("warm start failed", at=9.0)
    assert [line[10:].split(maxsplit=1)[1] for line in lines] == [
        "warm start 0/16",
        "warm start 2/16",
        "running",
        "warm start failed",
    ]


def test_the_thread_of_up_stops_even_without_nats(caplog: pytest.LogCaptureFixture) -> None:
    """Stopped while it retries its connect, the watcher ends within stop's join timeout."""
    lines: list[str] = []
    watcher = EventWatcherThread("nats://127.0.0.1:1", EventTracker(EventPrinter(lines.append)))
    with caplog.at_level(logging.WARNING, logger="coevolve.cli.events"):
        watcher.start()
        wait_until_sync(lambda: "retrying" in caplog.text, 60, "a failed connect, retried")
        watcher.stop(timeout_s=5.0)
    assert not watcher._thread.is_alive()


def test_the_thread_of_up_prints_and_stops(settings: Settings) -> None:
    lines: list[str] = []
    watcher = EventWatcherThread(settings.bus.url, EventTracker(EventPrinter(lines.append)))
    watcher.start()

    async def publish_until_seen(seen: Callable[[], bool]) -> None:
        bus = await connect(settings)
        try:
            with anyio.fail_after(15):
                while not seen():
                    await bus.publish_core(
                        heartbeat_subject("learner"), learner_heartbeat("warm start", 3, 16)
                    )
                    await anyio.sleep(0.2)
        finally:
            await bus.close()

    anyio.run(publish_until_seen, lambda: any("warm start 3/16" in line for line in lines))
    watcher.stop(timeout_s=5.0)  # it ends within this join timeout
    assert not watcher._thread.is_alive()
