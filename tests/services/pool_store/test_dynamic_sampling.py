"""Dynamic sampling: tasks with differing recent scores first, a share for unseen tasks,
always-solved tasks retired, the origin mix kept; the uniform sampler still available.

Real DuckDB files; results go through ``record_results``. Statistical but seeded.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from coevolve.bench.sampling import SAMPLERS, pool_tasks, run_sampler, run_sized, true_probabilities
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import ConfigError, Settings
from coevolve.shared.messages import ORIGINS, RolloutResults, ScoreSample, Task

TaskFactory = Callable[..., Task]

MIX = {"seed": 0.5, "explored": 0.3, "synthesized": 0.2}
# per origin: tasks whose scores differ, never solved, always solved (one group: not yet
# retired), never rolled out
KINDS = {"mixed": 16, "failed": 24, "solved": 8, "unseen": 4}
GROUP_SCORES = {"mixed": [1.0, 0.0] * 4, "failed": [0.0] * 8, "solved": [1.0] * 8}


def record(store: PoolStore, task_id: str, scores: list[float]) -> None:
    group = f"group-{task_id}-{len(store.score_history(task_id))}"
    samples = [
        ScoreSample(task_id=task_id, policy_version=0, score=score, length=1) for score in scores
    ]
    assert store.record_results(RolloutResults(group_id=group, samples=samples))


def fill_by_kind(store: PoolStore, make_task: TaskFactory) -> dict[str, str]:
    """Tasks of every kind in every origin, one group recorded per seen task; id -> kind."""
    kinds: dict[str, str] = {}
    tasks: list[Task] = []
    for origin in ORIGINS:
        for kind, count in KINDS.items():
            for _ in range(count):
                task = make_task(origin=origin)
                tasks.append(task)
                kinds[task.id] = kind
    store.add_tasks(tasks)
    for task_id, kind in kinds.items():
        if kind != "unseen":
            record(store, task_id, GROUP_SCORES[kind])
    return kinds


def draw_counts(
    store: PoolStore, batches: int = 200, size: int = 16
) -> tuple[Counter[str], dict[str, float]]:
    """How often each task was drawn, and the share of draws per origin."""
    drawn: Counter[str] = Counter()
    origins: Counter[str] = Counter()
    for seed in range(batches):
        batch = store.sample_batch(size, MIX, seed=seed)
        assert len(batch) == size
        drawn.update(task.id for task in batch)
        origins.update(task.origin for task in batch)
    return drawn, {origin: origins[origin] / (batches * size) for origin in ORIGINS}


def per_task_rate(drawn: Counter[str], kinds: dict[str, str], kind: str) -> float:
    ids = [task_id for task_id, k in kinds.items() if k == kind]
    return sum(drawn[task_id] for task_id in ids) / len(ids)


def kind_shares(drawn: Counter[str], kinds: dict[str, str]) -> dict[str, float]:
    total = sum(drawn.values())
    shares: Counter[str] = Counter()
    for task_id, count in drawn.items():
        shares[kinds[task_id]] += count / total
    return dict(shares)


def test_dynamic_sampler_prefers_mixed_tasks_keeps_unseen_share_and_mix(
    db_path: Path, make_task: TaskFactory
) -> None:
    with PoolStore(db_path, sampling=SamplingConfig(sampler="dynamic")) as store:
        kinds = fill_by_kind(store, make_task)
        drawn, origins = draw_counts(store)
    mixed = per_task_rate(drawn, kinds, "mixed")
    assert mixed > 10 * per_task_rate(drawn, kinds, "failed")
    assert mixed > 10 * per_task_rate(drawn, kinds, "solved")
    assert per_task_rate(drawn, kinds, "failed") > 0  # the weight floor: still tried
    shares = kind_shares(drawn, kinds)
    # unseen: 4 tasks per origin weigh less than the seen ones (16 + 32 * 0.05), so they
    # get their configured share; 3200 draws put its standard deviation under 0.01
    assert shares["unseen"] == pytest.approx(0.25, abs=0.03)
    assert shares["mixed"] > 0.6
    assert origins == pytest.approx(MIX, abs=0.03)


def test_uniform_sampler_is_todays_behaviour(db_path: Path, make_task: TaskFactory) -> None:
    with PoolStore(db_path, sampling=SamplingConfig(sampler="uniform")) as store:
        kinds = fill_by_kind(store, make_task)
        drawn, origins = draw_counts(store, batches=100)
        rates = [per_task_rate(drawn, kinds, kind) for kind in KINDS]
        assert max(rates) < 1.4 * min(rates)
        assert origins == pytest.approx(MIX, abs=0.04)
        # without results, both samplers draw the same batch for a seed
        fresh = PoolStore(db_path.with_name("fresh.duckdb"))
        plain = PoolStore(db_path.with_name("plain.duckdb"), sampling=store.sampling)
        for pool in (fresh, plain):
            pool.add_tasks([make_task(id=f"same-{i}", origin=ORIGINS[i % 3]) for i in range(60)])
        for seed in range(5):
            ids = [t.id for t in fresh.sample_batch(12, MIX, seed=seed)]
            assert ids == [t.id for t in plain.sample_batch(12, MIX, seed=seed)]
        fresh.close()
        plain.close()


def test_always_solved_tasks_retire_after_consecutive_solved_groups(
    db_path: Path, make_task: TaskFactory
) -> None:
    sampling = SamplingConfig(retire_after=3)
    solved, interrupted, other = (make_task() for _ in range(3))
    with PoolStore(db_path, sampling=sampling) as store:
        store.add_tasks([solved, interrupted, other])
        for _ in range(2):
            record(store, solved.id, [1.0] * 8)
        assert store.get_task(solved.id).status == "active"  # type: ignore[union-attr]
        record(store, solved.id, [1.0] * 8)
        assert store.get_task(solved.id).status == "retired"  # type: ignore[union-attr]
        assert store.recent_scores(solved.id) is None
        for scores in ([1.0] * 8, [1.0] * 8, [1.0] * 7 + [0.0], [1.0] * 8):
            record(store, interrupted.id, scores)
        assert store.recent_scores(interrupted.id).solved_streak == 1  # type: ignore[union-attr]
        drawn = {t.id for seed in range(20) for t in store.sample_batch(2, seed=seed)}
        assert drawn == {interrupted.id, other.id}
    # the retirement is in the file, and the streak is rebuilt from it on open
    with PoolStore(db_path, sampling=sampling) as store:
        assert store.get_task(solved.id).status == "retired"  # type: ignore[union-attr]
        assert store.recent_scores(interrupted.id).solved_streak == 1  # type: ignore[union-attr]
        for _ in range(2):
            record(store, interrupted.id, [1.0] * 8)
        assert store.get_task(interrupted.id).status == "retired"  # type: ignore[union-attr]
        assert {t.id for t in store.sample_batch(4, seed=0)} == {other.id}


def test_uniform_sampler_never_retires(db_path: Path, make_task: TaskFactory) -> None:
    task = make_task()
    with PoolStore(db_path, sampling=SamplingConfig(sampler="uniform")) as store:
        store.add_tasks([task])
        for _ in range(5):
            record(store, task.id, [1.0] * 8)
        assert store.get_task(task.id).status == "active"  # type: ignore[union-attr]


def test_recent_scores_keep_the_window_and_survive_reopen_and_reactivation(
    db_path: Path, make_task: TaskFactory
) -> None:
    sampling = SamplingConfig(window=8)
    stale, mixed = make_task(), make_task()
    unseen = [make_task() for _ in range(3)]
    with PoolStore(db_path, sampling=sampling) as store:
        store.add_tasks([stale, mixed, *unseen])
        record(store, stale.id, [1.0, 0.0] * 4)
        assert store.recent_scores(stale.id).mixed  # type: ignore[union-attr]
        record(store, stale.id, [0.0] * 8)  # the window now holds only this group
        record(store, mixed.id, [0.0] * 8)
        record(store, mixed.id, [0.0] * 4 + [1.0] * 4)
        assert store.recent_scores(stale.id).recent == (0.0,) * 8  # type: ignore[union-attr]
        assert not store.recent_scores(stale.id).mixed  # type: ignore[union-attr]
        assert store.recent_scores(mixed.id).mixed  # type: ignore[union-attr]
        before = [[t.id for t in store.sample_batch(3, seed=seed)] for seed in range(10)]
        known = {task_id: store.recent_scores(task_id) for task_id in (stale.id, mixed.id)}
    with PoolStore(db_path, sampling=sampling) as store:
        assert {task_id: store.recent_scores(task_id) for task_id in known} == known
        assert before == [[t.id for t in store.sample_batch(3, seed=seed)] for seed in range(10)]
        store.set_status([mixed.id], "retired")
        assert store.recent_scores(mixed.id) is None
        store.set_status([mixed.id], "active")
        assert store.recent_scores(mixed.id) == known[mixed.id]


def test_uniform_group_share_from_the_file(store: PoolStore, make_task: TaskFactory) -> None:
    assert store.uniform_group_share().groups == 0
    assert store.uniform_group_share().share is None
    tasks = [make_task() for _ in range(3)]
    store.add_tasks(tasks)
    record(store, tasks[0].id, [0.0] * 8)
    record(store, tasks[1].id, [0.0, 1.0] * 4)
    cut = time.time()
    record(store, tasks[2].id, [0.5] * 8)
    everything = store.uniform_group_share()
    assert (everything.groups, everything.uniform) == (3, 2)
    assert everything.share == pytest.approx(2 / 3)
    recent = store.uniform_group_share(since=cut)
    assert (recent.groups, recent.uniform) == (1, 1)
    assert store.uniform_group_share(since=time.time() + 1).groups == 0


def test_sampling_config_is_typed_and_checked(settings: Settings) -> None:
    assert PoolStoreConfig().sampling == SamplingConfig()
    settings.services["pool_store"] = {"sampling": {"sampler": "uniform", "window": 4}}
    config = settings.section("pool_store", PoolStoreConfig)
    assert config.sampling == SamplingConfig(sampler="uniform", window=4)
    for bad, message in (
        ({"windw": 4}, "windw"),
        ({"sampler": "greedy"}, "sampler"),
        ({"unseen_share": 1.5}, "unseen_share"),
        ({"uniform_weight": 0.0}, "uniform_weight"),
        ({"window": 0}, "window"),
    ):
        settings.services["pool_store"] = {"sampling": bad}
        with pytest.raises(ConfigError, match=message):
            settings.section("pool_store", PoolStoreConfig)


def test_dynamic_sampler_lowers_the_share_of_uniform_groups() -> None:
    """The synthetic policy of ``coevolve bench sampling``, small: same pool, same number
    of groups, same seed; only the sampler differs."""
    rng = random.Random(7)
    tasks = pool_tasks(true_probabilities(60, rng), rng)
    uniform = run_sampler(SAMPLERS["uniform"], tasks, groups=240, seed=7)
    dynamic = run_sampler(SAMPLERS["dynamic"], tasks, groups=240, seed=7)
    assert uniform.groups == dynamic.groups == 240
    # 70 % of the tasks are never or always solved: about 0.7 of uniform draws give
    # uniform groups; dynamic sampling, once every task is seen, mostly draws the rest
    assert uniform.uniform_share > 0.6
    assert dynamic.uniform_share < uniform.uniform_share - 0.2
    assert dynamic.uniform_share_second_half < 0.5 * uniform.uniform_share_second_half
    assert uniform.retired == 0  # retiring itself: test_always_solved_tasks_retire_after_...(above)
    mix = {"seed": 0.5, "explored": 0.25, "synthesized": 0.25}
    assert dynamic.origin_shares() == pytest.approx(mix, abs=0.1)


def test_in_a_default_runs_regime_learnability_draws_fewer_uniform_groups() -> None:
    """124 tasks and 60 groups, as in a 30-minute run: the default weights against uniform
    sampling and against the learnability sampler's earlier weights (unseen 1)."""
    shares = run_sized(seeds=3)
    assert shares["uniform"]["mean"] > 0.45
    assert shares["learnability"]["mean"] < shares["learnability, earlier weights"]["mean"] - 0.1
    assert shares["learnability"]["mean"] < shares["uniform"]["mean"] - 0.1
