"""How many unconsumed groups rollout allows the learner: more while it waits for data."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.config import Settings, load_settings
from coevolve.shared.messages import GRPO_STEP_PHASE, WAITING_FOR_DATA_PHASE, Heartbeat
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import heartbeat_subject
from tests.support.wait import wait_until


def beat(phase: str, age_s: float = 0.0) -> Heartbeat:
    sent = time.time() - age_s
    return Heartbeat(
        service="learner",
        instance="i",
        pid=os.getpid(),
        host="h",
        started_at=sent,
        sent_at=sent,
        phase=phase,
    )


def test_rollout_goes_on_while_the_learner_holds_its_step_for_data(tmp_path: Path) -> None:
    actor = RolloutActor(load_settings(run_dir=str(tmp_path / "run")))
    config = actor.config
    assert config.max_unconsumed_groups_while_learner_waits > config.max_unconsumed_groups
    assert actor.backlog_limit() == config.max_unconsumed_groups  # no heartbeat heard yet
    actor.learner_beat = beat(GRPO_STEP_PHASE)
    assert actor.backlog_limit() == config.max_unconsumed_groups
    actor.learner_beat = beat(WAITING_FOR_DATA_PHASE)
    assert actor.backlog_limit() == config.max_unconsumed_groups_while_learner_waits
    # a learner that went silent while waiting is not taken at its word
    actor.learner_beat = beat(WAITING_FOR_DATA_PHASE, age_s=60.0)
    assert actor.backlog_limit() == config.max_unconsumed_groups


@pytest.mark.anyio
async def test_rollout_hears_the_learners_heartbeat_on_the_bus(settings: Settings) -> None:
    actor = RolloutActor(settings)
    bus = await Bus.connect(settings.bus, "test")
    actor._bus = bus  # its loop alone, without the engine a started actor loads
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.watch_learner)

            async def heard() -> bool:
                await bus.publish_core(heartbeat_subject("learner"), beat(WAITING_FOR_DATA_PHASE))
                return actor.learner_beat is not None

            await wait_until(heard, 10, "the learner's heartbeat heard")
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
    limit = actor.config.max_unconsumed_groups_while_learner_waits
    assert actor.backlog_limit() == limit
