"""signal-monitor as a service on real NATS: groups in, signals out, state kept across a
restart, tasks fetched from pool-store."""

from __future__ import annotations

import pytest

from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.signal_monitor.actor import SignalMonitorActor
from coevolve.shared.config import Settings
from coevolve.shared.messages import Signal, decode, derived_id, encode
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS, SIGNALS_ALL
from tests.dataloop.dataloop_harness import (
    POOL_WITH_ENTRIES,
    filesystem_seed_tasks,
    mixed_group,
)
from tests.support.actors import running
from tests.support.pool_store import pool_answering
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


async def test_signals_published_and_state_survives_a_restart(settings: Settings) -> None:
    first, second = filesystem_seed_tasks(2)
    settings.services.update(
        pool_store=POOL_WITH_ENTRIES,
        signal_monitor={"detectors": {"kinds": ["boundary", "forgetting"], "cooldown_s": 0}},
    )
    bus = await Bus.connect(settings.bus, "test")
    live = await bus.nc.subscribe(SIGNALS_ALL)
    group = mixed_group(first)
    try:
        async with running([PoolStoreActor(settings)]):
            await pool_answering(bus, seeded=True)
            monitor = SignalMonitorActor(settings)
            async with running([monitor]) as [runner]:
                await bus.publish(ROLLOUT_GROUPS, group)
                await wait_until(lambda: monitor.published, 60, "a signal")
            message = await live.next_msg(timeout=5)
            signal = decode(message.data, Signal)
            assert message.subject == "coevolve.signals.boundary"
            assert signal.id == derived_id("signal", group.id, "boundary")
            assert signal.task == first and signal.trajectory.reward == 0.0
            assert signal.evidence["successes"] == 2 and signal.evidence["failures"] == 2
            assert message.headers is not None and message.headers["Nats-Msg-Id"] == signal.id
            assert runner.stats.processed == 1

            # a new instance loads the saved state: the group is known, the window kept
            restarted = SignalMonitorActor(settings)
            async with running([restarted]) as [runner]:
                await bus.js.publish(
                    ROLLOUT_GROUPS, encode(group), headers={"Nats-Msg-Id": "redelivered"}
                )
                # a failed group of the first task: forgetting (it scored 0.5 before)
                forgotten = mixed_group(first, rewards=(0.0, 0.0, 0.0, 0.0))
                await bus.publish(ROLLOUT_GROUPS, forgotten)
                await bus.publish(ROLLOUT_GROUPS, mixed_group(second))
                await wait_until(lambda: runner.stats.processed >= 3, 60, "three groups")
            assert restarted.monitor.state.groups_processed == 3
            assert restarted.published == {"forgetting": 1, "boundary": 1}
            assert restarted.monitor.state.score_windows[first.id] == [0.5, 0.0]
    finally:
        await bus.close()


async def test_a_group_waits_for_pool_store(settings: Settings) -> None:
    """Without pool-store the task cannot be fetched: the group is handed back, then
    processed once pool-store is up."""
    [task] = filesystem_seed_tasks(1)
    settings.services.update(pool_store=POOL_WITH_ENTRIES)
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    monitor = SignalMonitorActor(settings)
    try:
        async with running([monitor]) as [runner]:
            await bus.publish(ROLLOUT_GROUPS, mixed_group(task))
            await wait_until(lambda: runner.stats.failed >= 1, 30, "a failed attempt")
            assert not monitor.published
            async with running([PoolStoreActor(settings)]):
                await wait_until(lambda: monitor.published, 60, "the signal")
                await wait_until(lambda: runner.stats.processed >= 1, 60, "the group processed")
        assert monitor.published == {"boundary": 1} and runner.stats.processed == 1
    finally:
        await bus.close()
