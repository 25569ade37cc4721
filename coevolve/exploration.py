"""Exploration requests on the bus, as ``coevolve explore``, the experiment's random arm
and the data-loop benchmark send them."""

from __future__ import annotations

from coevolve.shared.messages import ExplorationRequest, Task
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import EXPLORATION_REQUESTS


async def publish_requests(
    bus: Bus, tasks: list[Task], rounds: int, vary: bool = False
) -> list[ExplorationRequest]:
    requests = [ExplorationRequest(task=task, rounds=rounds, vary=vary) for task in tasks]
    for request in requests:
        await bus.publish(EXPLORATION_REQUESTS, request)
    return requests
