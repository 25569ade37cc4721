"""pool-store as a service samples dynamically: real NATS, real DuckDB, results arriving on
their stream, batches asked for with ``PoolClient.sample``."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import RolloutResults, ScoreSample, Task
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import ROLLOUT_RESULTS
from tests.support.pool_store import pool_answering
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio

SCORES = {"mixed": [0.0, 1.0] * 4, "failed": [0.0] * 8, "solved": [1.0] * 8}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def task(kind: str, index: int) -> Task:
    return Task(id=f"{kind}-{index}", environment="bfcl", user_turns=[f"{kind} task {index}"])


async def test_service_prefers_mixed_tasks_and_retires_solved_ones(settings: Settings) -> None:
    settings.services["pool_store"] = {
        "seed_environments": [],
        "feed_jobs": False,
        "sampling": {"retire_after": 1, "uniform_weight": 0.05},
    }
    tasks = [task(kind, i) for kind in SCORES for i in range(10)]
    runner = ActorRunner(PoolStoreActor(settings))
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    drawn: Counter[str] = Counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runner.run(handle_signals=False))
        client = await pool_answering(bus)
        await client.add_tasks(tasks)
        for item in tasks:
            samples = [
                ScoreSample(task_id=item.id, policy_version=0, score=score, length=1)
                for score in SCORES[item.id.split("-")[0]]
            ]
            await bus.publish(ROLLOUT_RESULTS, RolloutResults(group_id=item.id, samples=samples))

        async def all_recorded() -> bool:
            return (await client.stats()).results >= len(tasks) * 8

        await wait_until(all_recorded, 60, "every result recorded", poll_s=0.1)
        for seed in range(40):
            drawn.update(t.id.split("-")[0] for t in await client.sample(4, seed=seed))
        runner.request_stop()
    await bus.close()

    assert drawn["solved"] == 0  # retired after one all-solved group
    assert drawn["mixed"] > 5 * drawn["failed"] > 0
    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        assert {t.status for t in store.list_tasks() if t.id.startswith("solved")} == {"retired"}
        share = store.uniform_group_share()
        assert (share.groups, share.uniform) == (30, 20)
