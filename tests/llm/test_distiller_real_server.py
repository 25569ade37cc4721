"""The distiller against the real llama.cpp server (the session fixture in conftest.py),
greedy: it draws advice from a group's better and worse attempts, and as a service on a
real NATS it hands that advice to a real pool-store, whose next rollout job of a similar
task carries it."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from coevolve.services.distiller.actor import DistillerActor
from coevolve.services.distiller.config import DistillerConfig
from coevolve.services.distiller.handler import distil
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import rollout_jobs
from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.messages import Experience
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS
from coevolve.shared.structured import Rejection
from tests.support.messages import NOTES_TASK, notes_group
from tests.support.pool_store import pool_answering

pytestmark = [pytest.mark.timeout(400), pytest.mark.anyio]

GREEDY = {"roles": {"distiller": {"temperature": 0.0}}}
SAMPLED = {"roles": {"distiller": {"temperature": 0.8}}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.usefixtures("on_server")
async def test_the_distiller_draws_advice_from_the_better_and_worse_attempt() -> None:
    clients = RoleClients(role_settings(GREEDY))
    config = DistillerConfig()
    try:
        drawn = await distil(notes_group(), NOTES_TASK, clients["distiller"], config)
        group = notes_group()
        equal = msgspec.structs.replace(
            group,
            trajectories=[msgspec.structs.replace(t, reward=0.0) for t in group.trajectories],
        )
        nothing = await distil(equal, NOTES_TASK, clients["distiller"], config)
    finally:
        await clients.aclose()
    assert not isinstance(drawn, Rejection), drawn
    assert isinstance(drawn, Experience)
    assert 20 <= len(drawn.text) <= 300
    assert drawn.trajectory_ids == ["solved", "failed"] and drawn.rewards == [1.0, 0.0]
    assert drawn.functions == ["cd", "touch", "ls"]
    assert drawn.request == NOTES_TASK.user_turns[0]
    assert nothing is None  # equal rewards: nothing to contrast, the LLM is not asked


@pytest.mark.usefixtures("on_server")
async def test_the_distiller_service_hands_advice_to_pool_store_for_the_next_jobs(
    settings: Settings,
) -> None:
    settings.services = {
        "pool_store": {"seed_environments": [], "feed_jobs": False},
        "distiller": {"enabled": True},
        # sampled: greedy, the model writes this group's advice with a call and its
        # quotes ("... call `touch(file_name="), which the distiller rightly drops as
        # incomplete, every time; the group is published again until advice is kept
        "llm": SAMPLED,
    }
    pool = PoolStoreActor(settings)
    distiller = DistillerActor(settings)
    group = notes_group()
    runners = [ActorRunner(pool), ActorRunner(distiller)]
    bus = await Bus.connect(settings.bus, "test")
    try:
        await bus.ensure_streams()
        async with anyio.create_task_group() as tg:
            for runner in runners:
                tg.start_soon(lambda r=runner: r.run(handle_signals=False))
            client = await pool_answering(bus)
            await client.add_tasks([NOTES_TASK])
            with anyio.fail_after(300):
                # the distiller listens on a core subscription: publish until it has heard
                while pool.store is None or not pool.store.experiences():
                    if not distiller.queue and not distiller.published:
                        await bus.publish(ROLLOUT_GROUPS, group)
                    await anyio.sleep(1.0)
            config = PoolStoreConfig(sampling=SamplingConfig(sampler="uniform"))
            (job,) = await anyio.to_thread.run_sync(rollout_jobs, pool.store, 1, config, 1, 0)
            for runner in runners:
                runner.request_stop()
    finally:
        await bus.close()

    assert pool.store is not None
    (kept,) = pool.store.experiences()  # a group heard twice is kept once
    assert kept.task_id == NOTES_TASK.id and kept.group_id == group.id
    assert kept.trajectory_ids == ["solved", "failed"]
    assert distiller.published >= 1 and distiller.distil_s > 0
    assert job.task.id == NOTES_TASK.id and [e.id for e in job.experiences] == [kept.id]
