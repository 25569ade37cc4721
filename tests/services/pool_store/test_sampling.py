"""sample_batch: mixing by origin, filters, determinism (statistical but seeded)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Task

TaskFactory = Callable[..., Task]


def fill(
    store: PoolStore, make_task: TaskFactory, counts: dict[str, int], **fields: object
) -> list[Task]:
    tasks = [make_task(origin=origin, **fields) for origin, n in counts.items() for _ in range(n)]
    store.add_tasks(tasks)
    return tasks


def origin_shares(
    store: PoolStore, mix: dict[str, float] | None, batches: int = 60, size: int = 64
) -> dict[str, float]:
    drawn: Counter[str] = Counter()
    for seed in range(batches):
        drawn.update(task.origin for task in store.sample_batch(size, mix, seed=seed))
    total = sum(drawn.values())
    assert total == batches * size
    return {origin: drawn[origin] / total for origin in ("seed", "explored", "synthesized")}


def test_mix_proportions_follow_weights(store: PoolStore, make_task: TaskFactory) -> None:
    fill(store, make_task, {"seed": 300, "explored": 150, "synthesized": 100})
    shares = origin_shares(store, {"seed": 0.5, "explored": 0.3, "synthesized": 0.2})
    # 3840 draws: the binomial standard deviation of each share is under 0.01
    assert shares == pytest.approx({"seed": 0.5, "explored": 0.3, "synthesized": 0.2}, abs=0.03)


def test_weights_renormalise_over_origins_with_tasks(
    store: PoolStore, make_task: TaskFactory
) -> None:
    fill(store, make_task, {"seed": 200, "explored": 200})
    shares = origin_shares(store, {"seed": 0.2, "explored": 0.2, "synthesized": 0.6}, batches=40)
    assert shares["synthesized"] == 0
    assert shares["seed"] == pytest.approx(0.5, abs=0.04)


def test_origin_without_weight_is_never_drawn(store: PoolStore, make_task: TaskFactory) -> None:
    fill(store, make_task, {"seed": 50, "explored": 50, "synthesized": 50})
    shares = origin_shares(store, {"explored": 1.0}, batches=10)
    assert shares == {"seed": 0.0, "explored": 1.0, "synthesized": 0.0}


def test_no_mix_draws_tasks_uniformly(store: PoolStore, make_task: TaskFactory) -> None:
    fill(store, make_task, {"seed": 120, "explored": 40, "synthesized": 40})
    shares = origin_shares(store, None)
    assert shares == pytest.approx({"seed": 0.6, "explored": 0.2, "synthesized": 0.2}, abs=0.03)
    assert origin_shares(store, {}, batches=5) == origin_shares(store, None, batches=5)


def test_same_seed_same_batch_and_distinct_tasks(store: PoolStore, make_task: TaskFactory) -> None:
    fill(store, make_task, {"seed": 100, "explored": 100})
    mix = {"seed": 0.5, "explored": 0.5}
    first = [t.id for t in store.sample_batch(64, mix, seed=11)]
    assert first == [t.id for t in store.sample_batch(64, mix, seed=11)]
    assert first != [t.id for t in store.sample_batch(64, mix, seed=12)]
    assert len(set(first)) == 64


def test_every_task_of_an_origin_gets_drawn(store: PoolStore, make_task: TaskFactory) -> None:
    tasks = fill(store, make_task, {"seed": 30})
    seen = {t.id for seed in range(20) for t in store.sample_batch(8, seed=seed)}
    assert seen == {t.id for t in tasks}


def test_small_origin_repeats_to_keep_the_mix(store: PoolStore, make_task: TaskFactory) -> None:
    fill(store, make_task, {"seed": 200, "explored": 3})
    batch = store.sample_batch(64, {"seed": 0.5, "explored": 0.5}, seed=5)
    explored = [t.id for t in batch if t.origin == "explored"]
    assert len(batch) == 64
    assert len(explored) > 20
    assert len(set(explored)) == 3
    seeds = [t.id for t in batch if t.origin == "seed"]
    assert len(set(seeds)) == len(seeds)


def test_retired_and_other_environments_are_excluded(
    store: PoolStore, make_task: TaskFactory
) -> None:
    bfcl = fill(store, make_task, {"seed": 300, "explored": 300})
    other = fill(store, make_task, {"seed": 300, "explored": 12}, environment="toy")
    retired = {t.id for t in bfcl[::3]}
    store.set_status(sorted(retired), "retired")
    for seed in range(10):
        # explored: 200 of 312 keys match (rejection path); seed: 200 of 600
        batch = store.sample_batch(
            64, {"seed": 0.5, "explored": 0.5}, environment="bfcl", seed=seed
        )
        assert len(batch) == 64
        assert len({t.id for t in batch}) == 64
        assert all(t.environment == "bfcl" and t.status == "active" for t in batch)
        assert not retired & {t.id for t in batch}
        # toy explored tasks are 12 of 312 keys (under 5 %): the listing path
        toy = store.sample_batch(8, {"explored": 1.0}, environment="toy", seed=seed)
        assert len({t.id for t in toy}) == 8
        assert {t.id for t in toy} <= {t.id for t in other if t.origin == "explored"}


def test_empty_pool_and_bad_arguments(store: PoolStore, make_task: TaskFactory) -> None:
    assert store.sample_batch(8, {"seed": 1.0}) == []
    fill(store, make_task, {"seed": 5})
    assert store.sample_batch(0) == []
    assert store.sample_batch(8, environment="nowhere") == []
    with pytest.raises(ValueError, match="unknown origins"):
        store.sample_batch(8, {"mystery": 1.0})
    with pytest.raises(ValueError, match="finite and >= 0"):
        store.sample_batch(8, {"seed": -1.0})
    with pytest.raises(ValueError, match="no weight"):
        store.sample_batch(8, {"explored": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        store.sample_batch(-1)


def test_retired_tasks_stay_out_after_reopen(
    store: PoolStore, make_task: TaskFactory, db_path: Path
) -> None:
    tasks = fill(store, make_task, {"seed": 10, "explored": 2})
    store.set_status([t.id for t in tasks[:4]], "retired")
    store.close()
    with PoolStore(db_path) as reopened:
        batch = reopened.sample_batch(6, {"seed": 1.0}, seed=3)
        assert {t.id for t in batch} == {t.id for t in tasks[4:10]}
        reopened.set_status([tasks[0].id], "active")
        assert tasks[0].id in {t.id for t in reopened.sample_batch(7, {"seed": 1.0}, seed=3)}
