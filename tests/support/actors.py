"""Actors run in-process by a test, each under its own ActorRunner, on the test's NATS."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import anyio
from nats.aio.msg import Msg

from coevolve.shared.messages import Heartbeat, decode
from coevolve.shared.runtime.actor import Actor, ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import heartbeat_subject


@asynccontextmanager
async def running(actors: Sequence[Actor]) -> AsyncIterator[list[ActorRunner]]:
    """Run ``actors`` (each its own ActorRunner) until the block ends."""
    runners = [ActorRunner(actor) for actor in actors]
    async with anyio.create_task_group() as tg:
        for runner in runners:
            tg.start_soon(partial(runner.run, handle_signals=False))
        try:
            yield runners
        finally:
            for runner in runners:
                runner.request_stop()


async def heartbeats_of(bus: Bus, service: str) -> list[Heartbeat]:
    """The heartbeats ``service`` sends from now on: the list grows as they come."""
    beats: list[Heartbeat] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(decode(msg.data, Heartbeat))

    await bus.nc.subscribe(heartbeat_subject(service), cb=on_beat)
    return beats
