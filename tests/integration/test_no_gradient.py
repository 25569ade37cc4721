"""A step whose groups all scored alike teaches nothing: the learner says so and why, as
its phase, which ``coevolve status`` and ``up``'s event lines show (real NATS, SmolLM2)."""

from __future__ import annotations

from functools import partial

import anyio
import pytest

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.learner.handler import NO_GRADIENT_PHASE, no_gradient_reason
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import PolicyVersion, decode
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import POLICY_UPDATES, ROLLOUT_GROUPS
from tests.support.actors import heartbeats_of
from tests.support.messages import rewarded_group
from tests.support.rollout import sampled_group

pytestmark = pytest.mark.anyio


async def test_a_step_on_groups_that_all_scored_zero_says_why(loop_settings: Settings) -> None:
    learner = LearnerActor(loop_settings)
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()
    updates = await bus.nc.subscribe(POLICY_UPDATES)
    beats = await heartbeats_of(bus, "learner")
    group, _ = await sampled_group(loop_settings, bus, seed_tasks()[0], rewards=(0.0, 0.0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(ActorRunner(learner).run, handle_signals=False))
        assert decode((await updates.next_msg(timeout=240)).data, PolicyVersion).version == 0
        await bus.publish(ROLLOUT_GROUPS, group)
        with anyio.fail_after(120):
            while not any(beat.phase == NO_GRADIENT_PHASE for beat in beats):
                await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    await bus.close()
    beat = next(beat for beat in beats if beat.phase == NO_GRADIENT_PHASE)
    assert beat.progress_done == 1 and "scored 0" in beat.detail
    assert learner.learner is not None and learner.learner.version == 0  # none published


def test_the_reason_names_what_every_group_scored() -> None:
    learns = rewarded_group("a", "t1", "seed", 0, 0.0, 1.0)
    zero = rewarded_group("b", "t2", "seed", 0, 0.0, 0.0)
    solved = rewarded_group("c", "t3", "seed", 0, 1.0, 1.0)
    partial_credit = rewarded_group("d", "t4", "seed", 0, 0.4, 0.4)
    assert no_gradient_reason([zero, learns]) is None
    assert "scored 0" in (no_gradient_reason([zero, zero]) or "")
    assert "solved" in (no_gradient_reason([solved]) or "")
    assert "(0, 0.4)" in (no_gradient_reason([zero, partial_credit]) or "")
