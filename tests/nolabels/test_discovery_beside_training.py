"""With no labels, discovery completes beside training a D0 that `up` built only the first
tasks of: an idle explorer sends itself the unguided exploration of a start state of the
run's world, told which calls the pool's discovered tasks make, and explores it, until the
pool holds D0's target. With labels, or from a whole D0, it does not."""

from __future__ import annotations

from pathlib import Path

import anyio
import nats
import pytest

from coevolve.services.explorer.actor import ExplorerActor
from coevolve.services.explorer.discovery import calls_of, world_starts
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.shared.config import Settings
from coevolve.shared.messages import Exploration, ExplorationRequest, decode
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import EXPLORATION_REQUESTS, EXPLORATIONS
from coevolve.shared.task_sets import load_d0, write_d0
from tests.dataloop.dataloop_harness import WellFormedBrain, running
from tests.support.fake_llm import RoleFakeLLM
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def first_tasks_of(committed_d0: Path, target: int, out: Path) -> Path:
    """The committed D0 as `up` would mark the first tasks of a D0 of ``target`` tasks."""
    d0 = load_d0(committed_d0)
    d0.build.first_tasks_of = target
    write_d0(out, d0)
    return out


async def test_an_idle_explorer_discovers_a_start_state_with_no_labels(
    settings: Settings, committed_d0: Path, tmp_path: Path
) -> None:
    settings.labels = "none"
    settings.d0.file = str(first_tasks_of(committed_d0, 40, tmp_path / "d0.json"))
    fake = RoleFakeLLM(WellFormedBrain()).start()
    settings.services.update(
        llm=fake.llm_section(),
        explorer={"discover_when_idle_s": 1.0, "max_steps": 1, "record": None},
    )
    d0_calls = {calls_of(task) for task in load_d0(committed_d0).tasks}
    starts = {task.id: task for task in world_starts(settings)[0]}
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    requests = await bus.nc.subscribe(EXPLORATION_REQUESTS)
    explorations = await bus.nc.subscribe(EXPLORATIONS)
    try:
        async with running([PoolStoreActor(settings)]):

            async def seeded() -> bool:
                try:
                    return sum((await PoolClient(bus).stats()).tasks_by_origin.values()) > 0
                except Exception:  # pool-store's responder not up yet
                    return False

            await wait_until(seeded, 60, "pool-store seeded from D0")
            async with running([ExplorerActor(settings)]):
                request = decode((await requests.next_msg(timeout=60)).data, ExplorationRequest)
                exploration = decode((await explorations.next_msg(timeout=60)).data, Exploration)
    finally:
        fake.stop()
        await bus.close()
    assert request.task.id in starts and request.task == starts[request.task.id]
    assert request.task.user_turns == [] and request.task.ground_truth == []
    assert request.covered and set(request.covered) <= d0_calls
    assert exploration.mode == "unguided" and exploration.task.id == request.task.id
    assert exploration.signal_id is None and fake.calls.get("summarizer", 0) == 0


async def test_no_discovery_beside_a_whole_d0(settings: Settings, committed_d0: Path) -> None:
    settings.labels = "none"
    settings.d0.file = str(committed_d0)
    assert load_d0(committed_d0).build.first_tasks_of == 0
    with anyio.fail_after(10):  # returns before it needs the bus or the pool
        await ExplorerActor(settings)._discover_when_idle()


async def test_discovery_beside_training_stops_when_d0_is_complete(
    settings: Settings, committed_d0: Path, tmp_path: Path
) -> None:
    settings.labels = "none"
    size = len(load_d0(committed_d0).tasks)
    settings.d0.file = str(first_tasks_of(committed_d0, size, tmp_path / "d0.json"))
    settings.services["explorer"] = {"discover_when_idle_s": 1.0, "record": None}
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    requests = await bus.nc.subscribe(EXPLORATION_REQUESTS)
    explorer = ExplorerActor(settings)
    try:
        async with running([PoolStoreActor(settings), explorer]):

            def completed() -> bool:
                progress = explorer._progress
                return progress is not None and progress.phase == "D0 complete beside training"

            await wait_until(completed, 60, "the explorer's D0 complete")
        with pytest.raises(nats.errors.TimeoutError):  # nothing was sent to explore
            await requests.next_msg(timeout=0.5)
    finally:
        await bus.close()
    assert explorer._progress is not None and explorer._progress.done == size


def test_no_discovery_beside_training_with_labels_or_when_off(settings: Settings) -> None:
    assert ExplorerActor(settings).loops() == ()
    settings.labels = "none"
    assert len(ExplorerActor(settings).loops()) == 1
    settings.services["explorer"] = {"discover_when_idle_s": 0}
    assert ExplorerActor(settings).loops() == ()


@pytest.mark.parametrize("classes", [None, ["TradingBot"], "default"])
def test_discovery_starts_in_the_world_pool_store_seeds(
    settings: Settings, classes: list[str] | str | None
) -> None:
    if classes != "default":
        settings.services["pool_store"] = {"seed_classes": classes}
    seeded = settings.section("pool_store", PoolStoreConfig).seed_classes
    starts, named = world_starts(settings)
    assert named == seeded and starts
    if seeded is not None:
        assert all(set(start.initial_state) <= set(seeded) for start in starts)
