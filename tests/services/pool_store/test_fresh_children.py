"""Fresh children first: a synthesized task whose lineage names a signal is fed as a
rollout job before the sampler draws, once; then it competes like any task.

Real DuckDB files; children join through ``record_verdict`` (or ``add_tasks``), results
through ``record_results``, jobs through the job feed's own function
(``handler.rollout_jobs``) or ``sample_batch(..., jobs=True)`` with a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import rollout_jobs
from coevolve.services.pool_store.sampling import Sampler, SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Lineage, RolloutResults, ScoreSample, Task, Verdict

TaskFactory = Callable[..., Task]

HALF = [1.0, 0.0] * 4
SEEDS = 40


def record(store: PoolStore, task_id: str, scores: list[float], version: int = 3) -> None:
    group = f"group-{task_id}-{len(store.score_history(task_id))}"
    samples = [
        ScoreSample(task_id=task_id, policy_version=version, score=score, length=1)
        for score in scores
    ]
    assert store.record_results(RolloutResults(group_id=group, samples=samples))


def learnable_seeds(store: PoolStore, make_task: TaskFactory) -> list[Task]:
    """Seed tasks rolled out once, each solved half the time: the sampler's favourites."""
    seeds = [make_task(origin="seed") for _ in range(SEEDS)]
    store.add_tasks(seeds)
    for seed in seeds:
        record(store, seed.id, HALF)
    return seeds


def accept_child(
    store: PoolStore, make_task: TaskFactory, signal: str = "signal-1", version: int = 3
) -> Task:
    child = make_task(
        origin="synthesized",
        lineage=Lineage(
            signal_id=signal,
            signal_kind="boundary",
            parent_task_id="task-0",
            signal_version=version,
        ),
    )
    _, added = store.record_verdict(
        Verdict(candidate_id=f"candidate-{child.id}", accepted=True, reasons=[], task=child)
    )
    assert added == child.id
    return child


def no_unseen_floor(sampler: Sampler = "learnability", **fields: float) -> SamplingConfig:
    # without the unseen tasks' floor share the sampler alone almost never draws the child
    return SamplingConfig(sampler=sampler, unseen_share=0.0, **fields)  # type: ignore[arg-type]


@pytest.fixture
def seeded_store(db_path: Path, make_task: TaskFactory) -> Iterator[PoolStore]:
    """A store without the unseen tasks' floor share whose seed tasks are learnable."""
    with PoolStore(db_path, sampling=no_unseen_floor()) as store:
        learnable_seeds(store, make_task)
        yield store


@pytest.mark.parametrize("sampler", ["learnability", "dynamic", "uniform"])
def test_the_next_job_feed_draws_a_fresh_child_first_and_only_once(
    db_path: Path, make_task: TaskFactory, sampler: Sampler
) -> None:
    with PoolStore(db_path, sampling=no_unseen_floor(sampler)) as store:
        learnable_seeds(store, make_task)
        unguided = make_task(origin="synthesized", lineage=Lineage(parent_task_id="task-1"))
        explored = make_task(origin="explored", lineage=Lineage(signal_id="signal-9"))
        store.add_tasks([unguided, explored])
        child = accept_child(store, make_task)
        store.sample_batch(4, seed=0)  # a sample reply, not jobs: freshness is kept

        config = PoolStoreConfig(sampling=store.sampling)
        jobs = rollout_jobs(store, 4, config, queue_seq=0, first_round=0)
        # synthesized tasks, oldest first: the same machinery's unguided child, then the
        # signal's child, in half the slots
        assert [job.task.id for job in jobs[:2]] == [unguided.id, child.id]
        assert [job.task.id for job in jobs].count(child.id) == 1
        assert store.fresh_tasks() == []
        # a task fed once is fresh no more, and one not synthesized never is
        store.set_status([unguided.id, explored.id], "retired")
        store.set_status([explored.id], "active")
        assert store.fresh_tasks() == []


def test_a_child_fed_once_competes_by_learnability(
    seeded_store: PoolStore, make_task: TaskFactory
) -> None:
    child = accept_child(seeded_store, make_task)
    assert seeded_store.sample_batch(4, seed=0, jobs=True)[0].id == child.id
    assert seeded_store.recent_jobs(child.id) == 1  # the cap counts its job
    # fresh no more: an unseen task weighing 0.05 against 40 weighing 1
    later = [
        t.id for seed in range(1, 11) for t in seeded_store.sample_batch(4, seed=seed, jobs=True)
    ]
    assert child.id not in later


def test_fresh_share_zero_gives_the_sampler_every_slot(
    db_path: Path, make_task: TaskFactory
) -> None:
    with PoolStore(db_path, sampling=no_unseen_floor(fresh_share=0.0)) as store:
        learnable_seeds(store, make_task)
        child = accept_child(store, make_task)
        for seed in range(5):
            jobs = [t.id for t in store.sample_batch(4, seed=seed, jobs=True)]
            # the same draw as a sample reply: nothing comes before the sampler
            assert jobs == [t.id for t in store.sample_batch(4, seed=seed)]
            assert child.id not in jobs
        assert store.fresh_tasks() == [child.id]


def test_fresh_children_of_one_version_take_at_most_their_share_of_a_feed_in_join_order(
    seeded_store: PoolStore, make_task: TaskFactory
) -> None:
    children = [accept_child(seeded_store, make_task, f"signal-{n}") for n in range(4)]
    first = [t.id for t in seeded_store.sample_batch(4, seed=0, jobs=True)]
    assert first[:3] == [c.id for c in children[:3]]  # fresh_share 0.75 of 4 slots
    assert children[3].id not in first
    # a feed of one slot still gives it to a waiting child
    assert [t.id for t in seeded_store.sample_batch(1, seed=1, jobs=True)] == [children[3].id]
    assert seeded_store.fresh_tasks() == []


def test_a_newer_signals_children_are_fed_before_an_older_signals(
    seeded_store: PoolStore, make_task: TaskFactory
) -> None:
    older = [accept_child(seeded_store, make_task, f"old-{n}", version=3) for n in range(2)]
    newer = [accept_child(seeded_store, make_task, f"new-{n}", version=5) for n in range(2)]
    expected = [newer[0].id, newer[1].id, older[0].id, older[1].id]
    assert seeded_store.fresh_tasks() == expected
    fed = [t.id for seed in range(4) for t in seeded_store.sample_batch(1, seed=seed, jobs=True)]
    assert fed == expected


def test_a_child_more_versions_behind_than_the_contract_is_fresh_no_more(
    db_path: Path, make_task: TaskFactory
) -> None:
    with PoolStore(db_path, sampling=no_unseen_floor(), fresh_versions=2) as store:
        seeds = learnable_seeds(store, make_task)  # results of version 3
        on_time = accept_child(store, make_task, "signal-1", version=3)
        late = accept_child(store, make_task, "signal-2", version=3)
        record(store, seeds[0].id, HALF, version=5)  # two versions on: both still fresh
        assert store.sample_batch(1, seed=0, jobs=True)[0].id == on_time.id
        record(store, seeds[1].id, HALF, version=6)  # three: the window is past
        batch = [t.id for t in store.sample_batch(4, seed=1, jobs=True)]
        assert late.id not in batch
        assert store.fresh_tasks() == []
        # a task with no signal answers the newest version when it joined: fresh for two
        unguided = make_task(origin="synthesized", lineage=Lineage(parent_task_id="task-1"))
        store.add_tasks([unguided])
        record(store, seeds[2].id, HALF, version=8)
        assert store.sample_batch(1, seed=2, jobs=True)[0].id == unguided.id


def test_after_a_reopen_fresh_children_keep_their_versions_and_the_newest_is_known(
    db_path: Path, make_task: TaskFactory
) -> None:
    with PoolStore(db_path, sampling=no_unseen_floor(), fresh_versions=2) as store:
        seeds = learnable_seeds(store, make_task)
        record(store, seeds[0].id, HALF, version=7)
        stale = accept_child(store, make_task, "signal-1", version=4)
        recent = accept_child(store, make_task, "signal-2", version=6)
    with PoolStore(db_path, sampling=no_unseen_floor(), fresh_versions=2) as store:
        assert store.fresh_tasks() == [recent.id, stale.id]
        fed = [t.id for t in store.sample_batch(4, seed=0, jobs=True)]
        assert fed[0] == recent.id
        assert stale.id not in fed  # 7 - 4 > 2


def test_a_mix_without_synthesized_weight_leaves_children_waiting(
    seeded_store: PoolStore, make_task: TaskFactory
) -> None:
    child = accept_child(seeded_store, make_task)
    seeds_only = seeded_store.sample_batch(4, mix={"seed": 1.0}, seed=0, jobs=True)
    assert all(t.origin == "seed" for t in seeds_only)
    # still fresh: the next feed whose mix weighs synthesized tasks starts with it
    mixed = seeded_store.sample_batch(4, mix={"seed": 1.0, "synthesized": 0.01}, seed=0, jobs=True)
    assert mixed[0].id == child.id
    assert len({t.id for t in mixed}) == 4


def test_a_fresh_child_is_still_fresh_after_the_store_reopens(
    db_path: Path, make_task: TaskFactory
) -> None:
    sampling = no_unseen_floor()
    with PoolStore(db_path, sampling=sampling) as store:
        learnable_seeds(store, make_task)
        child = accept_child(store, make_task, "signal-1")
        rolled = accept_child(store, make_task, "signal-2")
        record(store, rolled.id, HALF)  # reported: not fresh
        retired = accept_child(store, make_task, "signal-3")
        store.set_status([retired.id], "retired")
    with PoolStore(db_path, sampling=sampling) as store:
        batch = [t.id for t in store.sample_batch(4, seed=0, jobs=True)]
        assert batch[0] == child.id
        assert retired.id not in batch
        assert store.fresh_tasks() == []
        store.set_status([retired.id], "active")  # back, never rolled out: fresh again
        assert store.fresh_tasks() == [retired.id]


def test_fresh_share_must_lie_between_zero_and_one() -> None:
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="fresh_share"):
            SamplingConfig(fresh_share=share)
    assert SamplingConfig().fresh_share == 0.75


def labelled_control_turn(make_task: TaskFactory, joined_at: float) -> Task:
    """A labelled train turn the labelled_control arm adds during a run: origin seed, its
    ground truth kept, marked in its lineage."""
    return make_task(origin="seed", lineage=Lineage(labelled_control=True), created_at=joined_at)


def test_labelled_control_turns_are_fresh_like_synthesized_ones_in_the_order_they_joined(
    seeded_store: PoolStore, make_task: TaskFactory
) -> None:
    child = accept_child(seeded_store, make_task)
    control = [labelled_control_turn(make_task, joined_at=1e10 + n) for n in range(2)]
    seeded_store.add_tasks(control)
    # a seed task without the mark, added late, is not new data: never fresh
    seeded_store.add_tasks([make_task(origin="seed", created_at=2e10)])
    # the synthesized child joined first, though its origin's sample keys sort last
    assert seeded_store.fresh_tasks() == [child.id, control[0].id, control[1].id]

    config = PoolStoreConfig(sampling=seeded_store.sampling)
    jobs = rollout_jobs(seeded_store, 6, config, queue_seq=0, first_round=0)
    assert [job.task.id for job in jobs[:3]] == [child.id, control[0].id, control[1].id]
    assert all(job.task.ground_truth for job in jobs[1:3])  # labels kept
    assert seeded_store.fresh_tasks() == []
    # a mix that leaves an origin out leaves its fresh tasks waiting
    late = labelled_control_turn(make_task, joined_at=3e10)
    seeded_store.add_tasks([late])
    seeded_store.sample_batch(4, mix={"synthesized": 1.0, "explored": 1.0}, seed=0, jobs=True)
    assert seeded_store.fresh_tasks() == [late.id]


def test_labelled_control_turns_stay_fresh_across_a_reopen_and_are_not_the_seeded_labels(
    db_path: Path, make_task: TaskFactory
) -> None:
    from coevolve.services.pool_store.handler import labelled_tasks_in

    with PoolStore(db_path, sampling=no_unseen_floor()) as store:
        explored = [make_task(origin="explored") for _ in range(3)]
        store.add_tasks(explored)
        control = labelled_control_turn(make_task, joined_at=1e10)
        store.add_tasks([control])
    with PoolStore(db_path, sampling=no_unseen_floor()) as store:
        assert store.fresh_tasks() == [control.id]
        assert store.stats().tasks_by_origin["seed"] == 1
        # a no-label run's pool-store refuses a pool seeded with labels, not this one
        assert labelled_tasks_in(store) == 0
        store.add_tasks([make_task(origin="seed")])
        assert labelled_tasks_in(store) == 1
        assert store.sample_batch(1, seed=0, jobs=True)[0].id == control.id
