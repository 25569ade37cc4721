"""Unguided discovery: where it starts and what it is told.

``coevolve discover`` builds D0 from these; with ``labels: none`` the explorer goes on
discovering beside training (``explorer.discover_when_idle_s``). Start states come from
``coevolve.shared.envs.start_tasks``: they carry no user turn and no ground truth, so
nothing labelled reaches a prompt.
"""

from __future__ import annotations

import random

from coevolve.shared.config import Settings
from coevolve.shared.envs import start_tasks
from coevolve.shared.failures import call_text
from coevolve.shared.messages import ExplorationRequest, Task, derived_id


def world_starts(settings: Settings) -> tuple[list[Task], list[str] | None]:
    """The environment's start states in the run's world (BFCL: ``pool_store.seed_classes``)
    and those classes."""
    environment = settings.d0.environment
    starts = start_tasks(environment)
    if environment != "bfcl":
        return starts, None
    from coevolve.shared.envs.bfcl.tasks import in_world, run_world

    classes = run_world(settings.services)
    if classes is None:
        return starts, None

    return [task for task in starts if in_world(task, classes)], list(classes)


def start_order(starts: list[Task], count: int, seed: int) -> list[Task]:
    """``count`` start states: every state once in a seeded order, then again, so the
    explorations spread over the states."""
    order: list[Task] = []
    rng = random.Random(seed)
    while len(order) < count:
        batch = list(starts)
        rng.shuffle(batch)
        order.extend(batch)
    return order[:count]


def calls_of(task: Task) -> str:
    """The task's calls as one line: two tasks with the same line teach the same thing."""
    return "; ".join(call_text(call) for turn in task.ground_truth for call in turn)


def discovery_request(
    settings: Settings, key: object, start: Task, covered: list[str]
) -> ExplorationRequest:
    """The unguided exploration of ``start``, told which calls are ``covered`` already;
    ``key`` makes its id (a redelivered request keeps it)."""
    return ExplorationRequest(
        id=derived_id("d0", settings.d0.seed, key, start.id),
        task=start,
        rounds=settings.d0.rounds,
        covered=covered,
    )
