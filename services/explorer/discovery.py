"""Unguided discovery: where it starts and what it is told.

``coevolve discover`` builds D0 from these; with ``labels: none`` the explorer completes a
D0 that `up` built only the first tasks of, beside training
(``explorer.discover_when_idle_s``). Start states come from
``coevolve.shared.envs.start_tasks``: they carry no user turn and no ground truth, so
nothing labelled reaches a prompt.
"""

from __future__ import annotations

import logging
import random

from coevolve.shared.config import Settings
from coevolve.shared.envs import start_tasks
from coevolve.shared.failures import call_text
from coevolve.shared.messages import ExplorationRequest, Task, derived_id
from coevolve.shared.task_sets import D0Error, load_d0

log = logging.getLogger(__name__)


def d0_to_complete(settings: Settings) -> int:
    """How many discovered tasks discovery beside training goes on to: the D0 target of a
    set that `up` built only the first tasks of; 0 for a whole D0 or none readable."""
    try:
        d0 = load_d0(settings.d0.path(settings.run_dir))
    except D0Error as exc:
        log.warning("discovery beside training: no D0 to complete: %s", exc)
        return 0
    return d0.build.first_tasks_of


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
