"""Actors run in-process by a test, each under its own ActorRunner, on the test's NATS."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import anyio

from coevolve.shared.runtime.actor import Actor, ActorRunner


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
