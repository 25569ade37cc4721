"""Sampling by learnability: every task, whatever its origin, weighs by how much a group on
it can teach; unseen tasks keep a floor share; no task takes more than its capped share of
the jobs fed.

Real DuckDB files; results go through ``record_results``; jobs through the job feed's own
function (``handler.rollout_jobs``). Statistical but seeded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import rollout_jobs
from coevolve.services.pool_store.sampling import JobShares, SamplingConfig, TaskScores
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import ConfigError, load_settings
from coevolve.shared.messages import RolloutResults, ScoreSample, Task

TaskFactory = Callable[..., Task]

# the default cap: no task takes more than 10 of any 200 consecutive jobs
MAX_TASK_SHARE = 0.05
SHARE_WINDOW = 200
LIMIT = 10

HALF = [1.0, 0.0] * 4
FAILED = [0.0] * 8
SOLVED = [1.0] * 8


def record(store: PoolStore, task_id: str, scores: list[float]) -> None:
    group = f"group-{task_id}-{len(store.score_history(task_id))}"
    samples = [
        ScoreSample(task_id=task_id, policy_version=0, score=score, length=1) for score in scores
    ]
    assert store.record_results(RolloutResults(group_id=group, samples=samples))


def feed(store: PoolStore, config: PoolStoreConfig, jobs: int, per_call: int = 4) -> list[str]:
    """Task ids of ``jobs`` jobs, fed as the service feeds them (``per_call`` missing)."""
    fed: list[str] = []
    calls = 0
    while len(fed) < jobs:
        batch = rollout_jobs(store, per_call, config, queue_seq=calls, first_round=len(fed))
        assert batch, "the feed must never run dry while tasks are active"
        fed.extend(job.task.id for job in batch)
        calls += 1
    return fed[:jobs]


def most_in_any_window(fed: list[str], task_id: str, window: int) -> int:
    """The most jobs of ``task_id`` in any ``window`` consecutive jobs."""
    hits = [1 if fed_id == task_id else 0 for fed_id in fed]
    running = sum(hits[:window])
    most = running
    for end in range(window, len(hits)):
        running += hits[end] - hits[end - window]
        most = max(most, running)
    return most


def scores(recent: list[float]) -> TaskScores:
    return TaskScores(origin="seed", environment="bfcl", sample_key=0, recent=tuple(recent))


def test_learnability_is_four_times_the_spread_of_recent_scores() -> None:
    config = SamplingConfig()
    assert config.sampler == "learnability"  # the default
    assert scores(HALF).learnability == pytest.approx(1.0)
    assert scores([1.0, 0.0, 0.0, 0.0] * 2).learnability == pytest.approx(4 * 0.25 * 0.75)
    for flat in (SOLVED, FAILED, [0.4] * 8):  # a constant partial credit teaches nothing
        assert scores(flat).learnability == 0.0
        assert scores(flat).weight(config) == config.uniform_weight  # the floor
    assert scores(HALF).weight(config) > 10 * scores(SOLVED).weight(config)
    # the dynamic sampler's weights are as they were
    dynamic = SamplingConfig(sampler="dynamic")
    assert scores([1.0, 0.0, 0.0, 0.0]).weight(dynamic) == 1.0
    assert scores(SOLVED).weight(dynamic) == dynamic.uniform_weight


def test_a_half_solved_task_outweighs_always_solved_and_failed_ones_in_every_origin(
    store: PoolStore, make_task: TaskFactory
) -> None:
    kinds: dict[str, str] = {}
    tasks: list[Task] = []
    for origin, count in (("seed", 30), ("synthesized", 6)):
        for kind in ("half", "failed", "solved"):
            for _ in range(count):
                task = make_task(origin=origin)
                tasks.append(task)
                kinds[task.id] = f"{origin}-{kind}"
    store.add_tasks(tasks)
    groups = {"half": HALF, "failed": FAILED, "solved": SOLVED}
    for task_id, kind in kinds.items():
        record(store, task_id, groups[kind.split("-")[1]])
    drawn: Counter[str] = Counter()
    for seed in range(300):
        batch = store.sample_batch(8, seed=seed)
        assert len(batch) == len({t.id for t in batch}) == 8
        drawn.update(kinds[t.id] for t in batch)
    per_task = {kind: drawn[kind] / (30 if kind.startswith("seed") else 6) for kind in drawn}
    for origin in ("seed", "synthesized"):
        half = per_task[f"{origin}-half"]
        assert half > 10 * per_task[f"{origin}-failed"] > 0  # floor: still drawn
        assert half > 10 * per_task[f"{origin}-solved"] > 0
    # no per-origin shares: a half-solved task weighs the same in either origin
    assert per_task["synthesized-half"] == pytest.approx(per_task["seed-half"], rel=0.25)


def test_one_task_cannot_take_more_than_its_capped_share_of_jobs(
    store: PoolStore, make_task: TaskFactory
) -> None:
    """124 seed tasks the policy always fails and one synthesized task it solves half the
    time: the only learnable task. Its weight alone would give it about 11 % of the jobs
    (1 / (1 + 124 x 0.05) = 14 % of single draws; the old origin mix gave it 25 %); the cap
    holds it to 10 of any 200 consecutive jobs."""
    seeds = [make_task(origin="seed") for _ in range(124)]
    learnable = make_task(origin="synthesized")
    store.add_tasks([*seeds, learnable])
    for task in seeds:
        record(store, task.id, FAILED)
    record(store, learnable.id, HALF)
    config = PoolStoreConfig()  # the defaults: no origin mix, a cap of 5 % of 200 jobs
    fed = feed(store, config, 1200)
    counts = Counter(fed)
    assert most_in_any_window(fed, learnable.id, SHARE_WINDOW) <= LIMIT
    assert counts[learnable.id] / len(fed) <= MAX_TASK_SHARE
    assert all(most_in_any_window(fed, t, SHARE_WINDOW) <= LIMIT for t in counts)
    # the cap is what holds it back: it is still the task drawn most, as often as allowed
    assert counts.most_common(1)[0][0] == learnable.id
    assert counts[learnable.id] / len(fed) > 0.8 * MAX_TASK_SHARE
    uncapped = Counter(t.id for seed in range(200) for t in store.sample_batch(4, seed=seed))
    assert uncapped[learnable.id] / 800 > 1.5 * MAX_TASK_SHARE  # about 11 % uncapped
    sampling = config.sampling
    assert (sampling.max_task_share, sampling.share_window) == (MAX_TASK_SHARE, SHARE_WINDOW)
    assert store.recent_jobs(learnable.id) == fed[-(SHARE_WINDOW - 1) :].count(learnable.id)


def test_the_cap_relaxes_to_one_over_the_tasks_in_a_small_pool(
    db_path: Path, make_task: TaskFactory
) -> None:
    assert JobShares(SamplingConfig()).limit(124) == 10
    assert JobShares(SamplingConfig()).limit(20) == 10
    assert JobShares(SamplingConfig()).limit(6) == 34  # ceil(200 / 6)
    with PoolStore(db_path) as store:
        tasks = [make_task() for _ in range(6)]
        store.add_tasks(tasks)
        record(store, tasks[0].id, HALF)
        for task in tasks[1:]:
            record(store, task.id, FAILED)
        fed = feed(store, PoolStoreConfig(), 600)
        for task in tasks:
            assert most_in_any_window(fed, task.id, 200) <= 34
        # the learnable task takes what the relaxed cap allows, the rest share the remainder
        assert Counter(fed)[tasks[0].id] / len(fed) == pytest.approx(34 / 200, abs=0.02)
        # one task alone: every job is it, one per call (jobs repeat no task in a batch)
        store.set_status([t.id for t in tasks[1:]], "retired")
        assert [job.task.id for job in rollout_jobs(store, 4, PoolStoreConfig(), 0, 0)] == [
            tasks[0].id
        ]


def test_unseen_tasks_keep_their_floor_share(store: PoolStore, make_task: TaskFactory) -> None:
    seen = [make_task(origin="seed") for _ in range(60)]
    unseen = [make_task(origin="explored") for _ in range(3)]
    store.add_tasks([*seen, *unseen])
    for task in seen:
        record(store, task.id, HALF)  # every seen task weighs the most a task can
    unseen_ids = {t.id for t in unseen}
    drawn = [t.id for seed in range(500) for t in store.sample_batch(4, seed=seed)]
    # max(unseen_share, 3 / 63): the floor; 2000 draws put its deviation near 0.01
    share = sum(task_id in unseen_ids for task_id in drawn) / len(drawn)
    assert share == pytest.approx(0.25, abs=0.03)


@pytest.mark.parametrize(
    ("seen_count", "seen_scores", "unseen_origin", "counted", "share_above"),
    [
        # each unseen task weighs unseen_weight 0.05, each always-failed one 0.005: 2 / 2.1
        pytest.param(20, FAILED, "synthesized", "unseen", 0.93, id="a fresh pool is explored"),
        # 4 tasks weighing 1 against 40 unseen weighing 0.05 each: 1 - max(0.25, 2 / 6);
        # with an unseen task weighing as much as a learnable one it was 4 / 44
        pytest.param(4, HALF, "seed", "seen", 0.55, id="a spread of scores is drawn again"),
    ],
)
def test_the_share_of_unseen_tasks_follows_what_the_seen_ones_can_teach(
    store: PoolStore,
    make_task: TaskFactory,
    seen_count: int,
    seen_scores: list[float],
    unseen_origin: str,
    counted: str,
    share_above: float,
) -> None:
    """A fresh pool is explored first; a task with a spread of scores is drawn again
    before new ones."""
    seen = [make_task() for _ in range(seen_count)]
    unseen = [make_task(origin=unseen_origin) for _ in range(40)]
    store.add_tasks([*seen, *unseen])
    for task in seen:
        record(store, task.id, seen_scores)
    counted_ids = {t.id for t in (seen if counted == "seen" else unseen)}
    drawn = [t.id for seed in range(200) for t in store.sample_batch(4, seed=seed)]
    share = sum(task_id in counted_ids for task_id in drawn) / len(drawn)
    assert share > share_above


def test_an_explicit_mix_still_splits_the_slots_by_origin(
    store: PoolStore, make_task: TaskFactory
) -> None:
    seeds = [make_task(origin="seed") for _ in range(40)]
    synthesized = [make_task(origin="synthesized") for _ in range(4)]
    store.add_tasks([*seeds, *synthesized])
    for task in [*seeds, *synthesized]:
        record(store, task.id, HALF)
    origins = Counter(
        t.origin
        for seed in range(100)
        for t in store.sample_batch(8, {"seed": 0.5, "synthesized": 0.5}, seed=seed)
    )
    assert origins["synthesized"] / 800 == pytest.approx(0.5, abs=0.05)
    demo = {t.origin for seed in range(20) for t in store.sample_batch(8, {"seed": 1.0}, seed=seed)}
    assert demo == {"seed"}


def test_the_window_of_jobs_is_rebuilt_from_the_results_on_open(
    db_path: Path, make_task: TaskFactory
) -> None:
    sampling = SamplingConfig(share_window=4, max_task_share=0.5)
    first, second = make_task(), make_task()
    with PoolStore(db_path, sampling=sampling) as store:
        store.add_tasks([first, second])
        for task_id in (first.id, first.id, second.id, first.id):
            record(store, task_id, HALF)
        assert store.recent_jobs(first.id) == 0  # results are not jobs
        store.sample_batch(2, jobs=True, seed=0)
        assert (store.recent_jobs(first.id), store.recent_jobs(second.id)) == (1, 1)
    with PoolStore(db_path, sampling=sampling) as store:
        # the last share_window - 1 groups recorded stand for the last jobs
        assert (store.recent_jobs(first.id), store.recent_jobs(second.id)) == (2, 1)
        assert store.recent_jobs("missing") == 0


def test_sampling_and_mix_config_are_checked(tmp_path: Path) -> None:
    settings = load_settings(run_dir=str(tmp_path / "run"))
    config = settings.section("pool_store", PoolStoreConfig)
    assert config.mix == {}  # no per-origin shares by default
    assert config.sampling.sampler == "learnability"
    settings.services["pool_store"] = {
        "mix": {"seed": 0.5, "synthesized": 0.5},
        "sampling": {"sampler": "dynamic", "max_task_share": 0.1, "share_window": 50},
    }
    config = settings.section("pool_store", PoolStoreConfig)
    assert config.mix == {"seed": 0.5, "synthesized": 0.5}
    assert config.sampling == SamplingConfig(sampler="dynamic", max_task_share=0.1, share_window=50)
    for bad, message in (
        ({"sampling": {"max_task_share": 0.0}}, "max_task_share"),
        ({"sampling": {"max_task_share": 1.5}}, "max_task_share"),
        ({"sampling": {"share_window": 0}}, "share_window"),
        ({"sampling": {"max_task_share": 0.001}}, "at least one job"),
        ({"sampling": {"unseen_weight": 0.0}}, "unseen_weight"),
        ({"sampling": {"unseen_weight": float("inf")}}, "unseen_weight"),
        ({"sampling": {"sampler": "greedy"}}, "sampler"),
        ({"mix": {"mystery": 1.0}}, "unknown origins"),
        ({"mix": {"seed": -1.0}}, "finite and >= 0"),
    ):
        settings.services["pool_store"] = bad
        with pytest.raises(ConfigError, match=message):
            settings.section("pool_store", PoolStoreConfig)
