"""A real pool-store for tests: waiting until it answers, and running it beside synchronous
code (a CLI invoked in the test's thread) on an event loop of its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import anyio.from_thread

from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.shared.config import Settings
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from tests.support.wait import wait_until


async def pool_answering(bus: Bus, timeout_s: float = 60.0, *, seeded: bool = False) -> PoolClient:
    """A pool client, once pool-store (just started) answers; with ``seeded``, once its
    pool holds tasks too."""
    client = PoolClient(bus)

    async def ready() -> bool:
        try:
            stats = await client.stats()
        except Exception:
            return False
        return not seeded or sum(stats.tasks_by_origin.values()) > 0

    what = "pool-store to answer with a seeded pool" if seeded else "pool-store to answer"
    await wait_until(ready, timeout_s, what, poll_s=0.1)
    return client


async def _until_answering(settings: Settings, timeout_s: float) -> None:
    bus = await Bus.connect(settings.bus, "probe")
    try:
        await pool_answering(bus, timeout_s)
    finally:
        await bus.close()


@contextmanager
def pool_store_in_portal(settings: Settings, timeout_s: float = 60.0) -> Iterator[ActorRunner]:
    """pool-store running on an event loop in a background thread (a blocking portal),
    answering by the time the block starts, and stopped when it ends."""
    runner = ActorRunner(PoolStoreActor(settings))
    with anyio.from_thread.start_blocking_portal() as portal:
        portal.start_task_soon(lambda: runner.run(handle_signals=False))
        try:
            portal.call(_until_answering, settings, timeout_s)
            yield runner
        finally:
            portal.call(runner.request_stop)
