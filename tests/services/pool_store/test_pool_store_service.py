"""pool-store as a service: real NATS, real DuckDB, request/reply and idempotent consumers."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import (
    Lineage,
    RolloutResults,
    ScoreSample,
    Task,
    TaskAdded,
    ToolCall,
    Verdict,
    decode,
    encode,
)
from coevolve.shared.pool_client import PoolError
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import POOL_RPC, ROLLOUT_RESULTS, TASK_ADDED, VERDICTS
from tests.support.pool_store import pool_answering

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_task(i: int, origin: str = "seed") -> Task:
    return Task(
        id=f"t{i}",
        environment="bfcl",
        user_turns=[f"create file {i}.txt"],
        ground_truth=[[ToolCall(name="touch", arguments={"file_name": f"{i}.txt"})]],
        origin=origin,  # type: ignore[arg-type]
    )


def pool_settings(settings: Settings) -> Settings:
    settings.services["pool_store"] = {"seed_environments": [], "feed_jobs": False}
    return settings


async def test_pool_store_service_api_and_idempotent_consumers(settings: Settings) -> None:
    settings = pool_settings(settings)
    runner = ActorRunner(PoolStoreActor(settings))
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runner.run(handle_signals=False))
        client = await pool_answering(bus)

        reply = await client.add_tasks([make_task(i) for i in range(10)])
        assert len(reply.added) == 10 and reply.duplicates == []
        again = await client.add_tasks([make_task(3)])
        assert again.added == [] and again.duplicates == ["t3"]
        batch = await client.sample(4, seed=1)
        assert len(batch) == 4 and {t.id for t in batch} <= {f"t{i}" for i in range(10)}
        fetched = await client.get("t7")
        assert fetched is not None and fetched.ground_truth == make_task(7).ground_truth
        assert await client.get("missing") is None

        # the same results message delivered twice (a redelivery, not a re-publish:
        # distinct Nats-Msg-Id so JetStream does not drop it) makes one row
        results = RolloutResults(
            id="results-1",
            group_id="g1",
            samples=[ScoreSample(task_id="t1", policy_version=0, score=1.0, length=12)],
        )
        for attempt in range(2):
            await bus.js.publish(
                ROLLOUT_RESULTS, encode(results), headers={"Nats-Msg-Id": f"r-{attempt}"}
            )

        added_events = await bus.js.pull_subscribe(TASK_ADDED, durable="test-events")
        verdict = Verdict(
            id="verdict-1",
            candidate_id="cand-1",
            accepted=True,
            reasons=["replay ok"],
            task=make_task(100, origin="explored"),
        )
        verdict.task.lineage = Lineage(signal_id="sig-1", signal_kind="boundary", trace_id="abc")
        await bus.publish(VERDICTS, verdict)
        added_ids: set[str] = set()
        with anyio.fail_after(10):
            while "t100" not in added_ids:
                events = await added_events.fetch(batch=20, timeout=5)
                added_ids |= {decode(m.data, TaskAdded).task_id for m in events}
        assert added_ids == {f"t{i}" for i in range(10)} | {"t100"}
        with anyio.fail_after(10):
            while (await client.stats()).results < 1:
                await anyio.sleep(0.1)
        await anyio.sleep(1.0)  # room for the duplicate to be (wrongly) recorded
        stats = await client.stats()
        assert stats.results == 1
        assert stats.tasks_by_origin.get("explored") == 1
        lineage = await client.lineage("t100")
        assert lineage.task is not None and lineage.chain["signal"]["kind"] == "boundary"

        # a request that does not decode gets an error reply, and the service answers on
        raw = await bus.nc.request(POOL_RPC, b"\x01garbage", timeout=5)
        assert b"error" in raw.data
        assert (await client.stats()).results == 1
        runner.request_stop()
    await bus.close()

    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        assert len(store.score_history("t1")) == 1
        assert store.get_task("t100") is not None


async def test_pool_client_raises_on_bad_requests(settings: Settings) -> None:
    settings = pool_settings(settings)
    runner = ActorRunner(PoolStoreActor(settings))
    bus = await Bus.connect(settings.bus, "test")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runner.run(handle_signals=False))
        client = await pool_answering(bus)
        with pytest.raises(PoolError, match="batch size"):
            await client.sample(0)
        runner.request_stop()
    await bus.close()


def test_data_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "pool.duckdb"
    with PoolStore(path) as store:
        store.add_tasks([make_task(1)])
    with PoolStore(path) as store:
        again = store.get_task("t1")
        assert again is not None and again.user_turns == make_task(1).user_turns


async def test_tasks_are_added_only_on_the_write_subject(settings: Settings) -> None:
    """pool.rpc is open to read-only users, so it refuses AddTasks; pool.add takes it."""
    from coevolve.shared.messages import AddTasks, ErrorReply, PoolReply, decode, encode

    runner = ActorRunner(PoolStoreActor(settings))
    bus = await Bus.connect(settings.bus, "test")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: runner.run(handle_signals=False))
        client = await pool_answering(bus)
        refused = await bus.nc.request(POOL_RPC, encode(AddTasks(tasks=[make_task(1)])), timeout=10)
        answer = decode(refused.data, PoolReply)  # type: ignore[arg-type]
        assert isinstance(answer, ErrorReply) and "coevolve.pool.add" in answer.error
        assert (await client.add_tasks([make_task(2)])).added == [make_task(2).id]
        runner.request_stop()
    await bus.close()
