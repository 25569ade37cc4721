"""An abandoned first connect ends: nats-py's connect loop can swallow a single cancel."""

from __future__ import annotations

import asyncio

import anyio
import nats
import pytest

from coevolve.shared.config import BusSettings
from coevolve.shared.runtime.bus import Bus, BusError, cancel_until_done

pytestmark = pytest.mark.anyio

UNREACHABLE = "nats://127.0.0.1:1"
ATTEMPTS = 100


async def _ignore(_: Exception) -> None:
    return None


async def _connect_then_abandon(delay_s: float) -> asyncio.Task[object]:
    connecting = asyncio.ensure_future(
        nats.connect(
            servers=[UNREACHABLE],
            connect_timeout=2.0,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=_ignore,
        )
    )
    await asyncio.sleep(delay_s)
    cancel_until_done(connecting)
    return connecting


async def test_every_abandoned_connect_to_an_unreachable_server_ends() -> None:
    # About 7 in 100 connects on this path outlive one plain cancel(), so 100 attempts
    # spread over the reconnect waits catch a helper that cancels only once.
    tasks = await asyncio.gather(*(_connect_then_abandon(i * 0.012) for i in range(ATTEMPTS)))
    _, still_running = await asyncio.wait(set(tasks), timeout=3.0)
    assert not still_running, f"{len(still_running)} of {ATTEMPTS} connects outlived cancel"


async def _still_running_after(before: set[asyncio.Task[object]]) -> list[asyncio.Task[object]]:
    """Tasks started since ``before`` that still run half a second later."""
    await asyncio.sleep(0.5)
    return [task for task in asyncio.all_tasks() - before if not task.done()]


async def _connect_cancelled_after(delay_s: float, connected: list[Bus]) -> None:
    with anyio.move_on_after(delay_s):
        connected.append(await Bus.connect(BusSettings(url=UNREACHABLE), name="test"))


async def test_a_connect_cancelled_by_its_caller_leaves_no_connect_behind() -> None:
    before = asyncio.all_tasks()
    connected: list[Bus] = []
    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(_connect_cancelled_after, i * 0.05, connected)
    assert not connected
    leftover = await _still_running_after(before)
    assert not leftover, f"{len(leftover)} connects outlived their caller"


async def test_a_connect_that_runs_out_of_time_leaves_no_connect_behind() -> None:
    before = asyncio.all_tasks()
    with pytest.raises(BusError, match="cannot reach NATS"):
        await Bus.connect(BusSettings(url=UNREACHABLE, connect_timeout_s=1.0), name="test")
    leftover = await _still_running_after(before)
    assert not leftover, leftover
