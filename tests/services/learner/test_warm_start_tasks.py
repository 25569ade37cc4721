"""Which seed tasks the warm start trains on: the same choice in the learner service and
in the lockstep schedule (``services/learner/warm_start.py``), on real BFCL tasks."""

from __future__ import annotations

import msgspec

from coevolve.services.learner.config import WarmStartConfig
from coevolve.services.learner.warm_start import warm_start_tasks
from coevolve.shared.envs.bfcl.tasks import seed_tasks, turn_tasks


def test_the_warm_start_keeps_distinct_tasks_of_its_grain_with_ground_truth() -> None:
    entries = seed_tasks()[:3]
    turns = [turn for entry in entries for turn in turn_tasks(entry)]
    without_truth = msgspec.structs.replace(entries[0], id="no_truth", ground_truth=[])
    sampled = [without_truth, *entries, turns[0], turns[0], *turns[1:]]

    chosen = warm_start_tasks(sampled, WarmStartConfig(tasks=4, grain="turn"))
    assert [task.id for task in chosen] == [task.id for task in turns[:4]]

    chosen = warm_start_tasks(sampled, WarmStartConfig(tasks=10, grain="entry"))
    assert [task.id for task in chosen] == [task.id for task in entries]

    chosen = warm_start_tasks(sampled, WarmStartConfig(tasks=2, grain="any"))
    assert [task.id for task in chosen] == [entries[0].id, entries[1].id]
