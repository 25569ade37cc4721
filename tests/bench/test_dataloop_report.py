"""The data-loop benchmark's parts, without `coevolve up` or a model: counting real bus
traffic and summarizing a real pool file."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import anyio
import pytest

from coevolve.bench.dataloop import (
    bench_minutes,
    summarize,
    watch_loop,
)
from coevolve.bus_tally import BusTally
from coevolve.run_figures import pool_summary
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import BusSettings
from coevolve.shared.messages import (
    Exploration,
    Heartbeat,
    Lineage,
    Origin,
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
from tests.support.messages import policy_version, untokenized_trajectory


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
        await bus.publish(POLICY_UPDATES, policy_version(3, bucket=POLICY_BUCKET))
        beat = Heartbeat(service="judge", instance="a", pid=1, host="h", started_at=0.0)
        await bus.publish_core(heartbeat_subject("judge"), beat)
        await bus.nc.flush()
    finally:
        await bus.close()


@pytest.mark.anyio
async def test_counts_families_signal_kinds_and_verdicts_on_a_real_bus(
    nats_server: NatsServer,
) -> None:
    counter = BusTally()
    async with anyio.create_task_group() as tg:
        await tg.start(watch_loop, BusSettings(url=nats_server.url), counter, 60.0)
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


def test_watch_loop_stops_at_its_duration(nats_server: NatsServer) -> None:
    counter = BusTally()
    started = time.monotonic()
    anyio.run(watch_loop, BusSettings(url=nats_server.url), counter, 1.0)
    assert time.monotonic() - started >= 0.9  # it watched for its duration, then returned


def test_seed_explorations_are_published_and_counted(nats_server: NatsServer) -> None:
    counter = BusTally()
    anyio.run(
        functools.partial(
            watch_loop, BusSettings(url=nats_server.url), counter, 1.5, seed_explorations=2
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
    result = summarize(BusTally(), summary, [1, 2], minutes=3.0)
    assert result["pool"] == {"seed": 4, "explored": 0, "synthesized": 2, "growth": 2}
    assert result["acceptance_rate"] == 0.4
    assert result["policy"]["files"] == 2


def test_minutes_come_from_the_environment_override() -> None:
    assert bench_minutes(quick=False, env={}) == 20.0
    assert bench_minutes(quick=True, env={}) == 3.0
    assert bench_minutes(quick=True, env={"COEVOLVE_BENCH_MINUTES": "0.5"}) == 0.5
    with pytest.raises(ValueError):
        bench_minutes(quick=False, env={"COEVOLVE_BENCH_MINUTES": "0"})
