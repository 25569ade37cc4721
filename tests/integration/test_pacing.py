"""The pacing contract as services: real NATS, DuckDB, BFCL environment and SmolLM2.

The learner holds its next step while the data loop has delivered fewer accepted tasks
than it owes (``pacing.tasks_per_step`` per step once ``grace_steps`` are done), and steps as soon
as pool-store records an accepted verdict.
"""

from __future__ import annotations

import json

import anyio
import msgspec
import pytest
from nats.aio.subscription import Subscription

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.learner.handler import PACING_FILE
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import (
    WAITING_FOR_DATA_PHASE,
    Lineage,
    PolicyVersion,
    Verdict,
    decode,
    new_id,
)
from coevolve.shared.pacing import PaceLedger, PacingSettings
from coevolve.shared.runtime.actor import Actor
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import (
    POLICY_UPDATES,
    ROLLOUT_GROUPS,
    VERDICTS,
)
from tests.support.actors import heartbeats_of, running
from tests.support.rollout import sampled_group

pytestmark = pytest.mark.anyio


async def paced_learner(
    settings: Settings, max_wait_s: float
) -> tuple[list[Actor], Bus, Subscription]:
    """Pool-store and a learner that owes one accepted task a step, with no grace; the bus
    and a subscription to policy updates."""
    settings.pacing = PacingSettings(
        tasks_per_step=1.0, grace_steps=0, poll_s=0.5, max_wait_s=max_wait_s
    )
    settings.services["pool_store"]["feed_jobs"] = False
    actors = [PoolStoreActor(settings), LearnerActor(settings)]
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    return actors, bus, await bus.nc.subscribe(POLICY_UPDATES)


async def test_learner_waits_for_the_data_loop_then_steps(loop_settings: Settings) -> None:
    actors, bus, updates = await paced_learner(loop_settings, max_wait_s=300.0)
    beats = await heartbeats_of(bus, "learner")
    task = seed_tasks()[0]
    group, _ = await sampled_group(loop_settings, bus, task)
    async with running(actors):
        assert decode((await updates.next_msg(timeout=240)).data, PolicyVersion).version == 0
        await bus.publish(ROLLOUT_GROUPS, group)
        # step 1 owes nothing (no step done yet)
        assert decode((await updates.next_msg(timeout=240)).data, PolicyVersion).version == 1
        await bus.publish(ROLLOUT_GROUPS, msgspec.structs.replace(group, id=new_id()))
        # step 2 owes one accepted task: none was delivered, so the learner waits
        with anyio.fail_after(60):
            while WAITING_FOR_DATA_PHASE not in [beat.phase for beat in beats]:
                await anyio.sleep(0.2)
        with pytest.raises(TimeoutError):
            await updates.next_msg(timeout=3)
        child = msgspec.structs.replace(
            task,
            id="task-child",
            origin="synthesized",
            lineage=Lineage(signal_id="signal-1", parent_task_id=task.id, signal_version=1),
        )
        await bus.publish(
            VERDICTS, Verdict(candidate_id="candidate-1", accepted=True, reasons=[], task=child)
        )
        assert decode((await updates.next_msg(timeout=240)).data, PolicyVersion).version == 2
    await bus.close()
    (wait,) = [
        json.loads(line) for line in (loop_settings.run_dir / PACING_FILE).read_text().splitlines()
    ]
    assert (wait["step"], wait["delivered"], wait["owed"]) == (2, 1, 1)
    assert wait["waited_s"] >= 3.0


async def test_a_wait_that_runs_out_is_not_repeated_until_the_loop_delivers(
    loop_settings: Settings,
) -> None:
    actors, bus, updates = await paced_learner(loop_settings, max_wait_s=3.0)
    group, _ = await sampled_group(loop_settings, bus, seed_tasks()[0])
    async with running(actors):
        assert decode((await updates.next_msg(timeout=240)).data, PolicyVersion).version == 0
        # step 1 owes nothing; steps 2 and 3 owe 1 and 2, and no task is ever delivered
        for version in (1, 2, 3):
            await bus.publish(ROLLOUT_GROUPS, msgspec.structs.replace(group, id=new_id()))
            received = decode((await updates.next_msg(timeout=240)).data, PolicyVersion)
            assert received.version == version
    await bus.close()
    waits = [
        json.loads(line) for line in (loop_settings.run_dir / PACING_FILE).read_text().splitlines()
    ]
    # step 2 waited the whole 3 s; step 3 did not wait: nothing was delivered since
    assert [(w["step"], w["ran_out"], w["owed"]) for w in waits] == [(2, True, 1)]
    assert waits[0]["waited_s"] >= 3.0


def test_a_stalled_loop_is_forgiven_its_debt_once_it_delivers_again() -> None:
    ledger = PaceLedger(PacingSettings(tasks_per_step=1.0, grace_steps=0))
    assert ledger.shortfall(steps_done=5, delivered=3) == 2
    ledger.stall(delivered=3)
    # stalled: no step waits while nothing new comes, however many steps pass
    assert [ledger.shortfall(steps, delivered=3) for steps in (5, 6, 9)] == [0, 0, 0]
    # a fourth task at step 9: square from the stall, that task one step ahead
    assert ledger.shortfall(steps_done=9, delivered=4) == 0
    assert ledger.owed(9) == 3 and ledger.owed(10) == 4
    assert ledger.shortfall(steps_done=11, delivered=4) == 1


def test_owed_tasks_follow_the_configured_pace() -> None:
    pacing = PacingSettings(tasks_per_step=1.5, grace_steps=2)
    assert [pacing.owed(steps) for steps in range(6)] == [0, 0, 0, 4, 6, 7]
    # 20 steps at one task a step owe 20, grace or not
    assert PacingSettings(tasks_per_step=1.0, grace_steps=2).owed(20) == 20
    assert pacing.shortfall(4, delivered=1) == 5
    assert pacing.shortfall(4, delivered=6) == 0
    assert not PacingSettings(tasks_per_step=0).waits
    assert not PacingSettings(when_behind="none").waits
    with pytest.raises(ValueError):
        PacingSettings(tasks_per_step=-1)
