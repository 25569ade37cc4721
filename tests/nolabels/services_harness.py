"""Pool-store, learner and rollout on a real NATS server until the warm-started policy is
published and the first rollout group is recorded."""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.learner.handler import NO_GRADIENT_PHASE
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.config import Settings
from coevolve.shared.messages import PoolStats, Task
from coevolve.shared.policy_sync import latest_policy
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from tests.support.status import status_row
from tests.support.wait import wait_until

SMALL_WARM_START = {
    "enabled": True,
    "tasks": 2,
    "epochs": 1,
    "min_steps": 0,
    "batch_size": 1,
    "max_len": 512,
}


@dataclass
class FirstSteps:
    announced_version: int
    learner: LearnerActor
    pool: PoolStats  # once a rollout group was recorded
    tasks: list[Task]  # the pool's tasks then (a sample of up to 1,000)


async def until_first_group(settings: Settings, demo_tasks: int) -> FirstSteps:
    """Run the three services with a small warm start and ``demo_tasks`` replayed tasks;
    stop them once v1 is announced and a rollout result is in the pool."""
    settings.services["learner"]["warm_start"] = dict(SMALL_WARM_START)
    settings.services["learner"]["demo_tasks"] = demo_tasks
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    learner = LearnerActor(settings)
    runners = [
        ActorRunner(PoolStoreActor(settings)),
        ActorRunner(learner),
        ActorRunner(RolloutActor(settings)),
    ]
    async with anyio.create_task_group() as tg:
        for runner in runners:
            tg.start_soon(lambda r=runner: r.run(handle_signals=False))
        # past the warm start; a first step whose groups all scored alike says "no gradient"
        past_warm_start = ("running", NO_GRADIENT_PHASE)
        await status_row(bus, "learner", lambda r: r["phase"] in past_warm_start, 300)
        announced = await latest_policy(bus)
        pool = PoolClient(bus)

        async def rolled_out() -> bool:
            return (await pool.stats()).results > 0

        await wait_until(rolled_out, 300, "a rollout result in the pool")
        stats = await pool.stats()
        tasks = await pool.sample(1000, seed=0)
        for runner in runners:
            runner.request_stop()
        tg.cancel_scope.cancel()
    await bus.close()
    assert announced is not None
    return FirstSteps(announced.version, learner, stats, tasks)
