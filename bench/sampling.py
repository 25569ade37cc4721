"""Benchmark of the samplers: the share of uniform rollout groups, uniform vs dynamic vs
learnability.

A synthetic policy: every task has a fixed true success probability p and a group is
``group_size`` Bernoulli(p) rewards. ``simulate`` hands out jobs from a real PoolStore in
small batches, as pool-store's job feed does, records each group and reads the share of
uniform groups back from the file. Two regimes, each sampler on the same pools and seeds:
long (400 tasks: half never solved, a fifth always; 3,000 groups, under pool-store's old
origin mix) and a default run's (124 seed tasks, 60 groups, 45% never solved and 5%
always, no mix, over 10 seeds; learnability also with its earlier weights). ``--quick``:
100 tasks and 400 groups, 3 seeds. Results: docs/pool-store.md.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coevolve.bench import tables
from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import ORIGINS, Origin, RolloutResults, ScoreSample, Task

# pool-store's default mix, and origins in the pool in other proportions than the mix
MIX = {"seed": 0.5, "explored": 0.25, "synthesized": 0.25}
POOL_ORIGINS: dict[Origin, float] = {"seed": 0.6, "explored": 0.2, "synthesized": 0.2}
NEVER_SOLVED = 0.5
ALWAYS_SOLVED = 0.2
GROUP_SIZE = 8
BATCH = 4


def true_probabilities(
    count: int,
    rng: random.Random,
    never_solved: float = NEVER_SOLVED,
    always_solved: float = ALWAYS_SOLVED,
    high: float = 0.95,
) -> list[float]:
    """Per task, the chance that one trajectory solves it: ``never_solved`` of them 0,
    ``always_solved`` 1, the rest uniform between 0.05 and ``high``."""
    never = round(count * never_solved)
    always = round(count * always_solved)
    between = [rng.uniform(0.05, high) for _ in range(count - never - always)]
    probabilities = [0.0] * never + [1.0] * always + between
    rng.shuffle(probabilities)
    return probabilities


def pool_tasks(
    probabilities: list[float], rng: random.Random, origin: Origin | None = None
) -> dict[str, tuple[Task, float]]:
    """A task per probability, of ``origin`` or one drawn by ``POOL_ORIGINS``; by task id."""
    origins = (
        [origin] * len(probabilities)
        if origin is not None
        else rng.choices(
            list(POOL_ORIGINS), weights=list(POOL_ORIGINS.values()), k=len(probabilities)
        )
    )
    tasks: dict[str, tuple[Task, float]] = {}
    for index, (task_origin, probability) in enumerate(zip(origins, probabilities, strict=True)):
        task = Task(
            id=f"sim-{index}",
            environment="bfcl",
            user_turns=[f"Move report_{index}.txt into the archive folder."],
            origin=task_origin,
        )
        tasks[task.id] = (task, probability)
    return tasks


@dataclass
class Simulation:
    """What one sampler did over a run of ``groups`` groups."""

    sampler: str
    groups: int
    uniform_share: float
    uniform_share_second_half: float
    drawn_by_origin: dict[str, int]
    retired: int

    def origin_shares(self) -> dict[str, float]:
        total = sum(self.drawn_by_origin.values())
        return {origin: self.drawn_by_origin.get(origin, 0) / total for origin in ORIGINS}


def simulate(
    store: PoolStore,
    success: dict[str, float],
    groups: int,
    seed: int,
    batch: int = BATCH,
    group_size: int = GROUP_SIZE,
    mix: dict[str, float] | None = MIX,
) -> Simulation:
    """Draw ``groups`` jobs from ``store`` (``batch`` at a time), roll each out with the
    synthetic policy and record its group; ``success`` is each task's true probability."""
    rng = random.Random(seed)
    drawn: Counter[str] = Counter()
    half_recorded_at = 0.0
    recorded = 0
    while recorded < groups:
        tasks = store.sample_batch(min(batch, groups - recorded), mix, seed=rng.getrandbits(32))
        if not tasks:
            raise RuntimeError("the pool has no active task left to sample")
        for task in tasks:
            if recorded == groups // 2:
                half_recorded_at = time.time()
            probability = success[task.id]
            samples = [
                ScoreSample(
                    task_id=task.id,
                    policy_version=0,
                    score=1.0 if rng.random() < probability else 0.0,
                    length=1,
                )
                for _ in range(group_size)
            ]
            group = RolloutResults(group_id=f"sim-group-{recorded}", samples=samples)
            assert store.record_results(group)
            drawn[task.origin] += 1
            recorded += 1
    overall = store.uniform_group_share()
    second_half = store.uniform_group_share(since=half_recorded_at)
    retired = sum(1 for task in store.list_tasks(limit=len(success)) if task.status != "active")
    assert overall.share is not None and second_half.share is not None
    return Simulation(
        sampler=store.sampling.sampler,
        groups=overall.groups,
        uniform_share=overall.share,
        uniform_share_second_half=second_half.share,
        drawn_by_origin=dict(drawn),
        retired=retired,
    )


def run_sampler(
    sampling: SamplingConfig,
    tasks: dict[str, tuple[Task, float]],
    groups: int,
    seed: int,
    mix: dict[str, float] | None = MIX,
) -> Simulation:
    """A fresh pool of ``tasks`` and one simulation with ``sampling``."""
    with (
        tempfile.TemporaryDirectory(prefix="coevolve-bench-sampling-") as tmp,
        PoolStore(Path(tmp) / "pool.duckdb", sampling=sampling) as store,
    ):
        store.add_tasks([task for task, _ in tasks.values()])
        success = {task_id: probability for task_id, (_, probability) in tasks.items()}
        return simulate(store, success, groups, seed, mix=mix)


SAMPLERS: dict[str, SamplingConfig] = {
    "uniform": SamplingConfig(sampler="uniform"),
    "dynamic": SamplingConfig(sampler="dynamic"),
    "learnability": SamplingConfig(),
}
EARLIER_LEARNABILITY = SamplingConfig(unseen_weight=1.0, uniform_weight=0.05)
RUN_TASKS, RUN_GROUPS, RUN_NEVER, RUN_ALWAYS = 124, 60, 0.45, 0.05


def run_sized(seeds: int) -> dict[str, dict[str, float]]:
    """Uniform-group share per sampler in a default run's regime: mean, least and most
    over ``seeds`` pools."""
    samplers = {**SAMPLERS, "learnability, earlier weights": EARLIER_LEARNABILITY}
    shares: dict[str, list[float]] = {name: [] for name in samplers}
    for seed in range(seeds):
        rng = random.Random(seed)
        probabilities = true_probabilities(RUN_TASKS, rng, RUN_NEVER, RUN_ALWAYS, high=0.6)
        tasks = pool_tasks(probabilities, rng, origin="seed")
        for name, sampling in samplers.items():
            simulation = run_sampler(sampling, tasks, RUN_GROUPS, seed, mix={})
            shares[name].append(simulation.uniform_share)
    return {
        name: {
            "mean": round(sum(values) / len(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }
        for name, values in shares.items()
    }


def run(quick: bool) -> dict[str, Any]:
    task_count, groups, seed = (100, 400, 0) if quick else (400, 3000, 0)
    rng = random.Random(seed)
    tasks = pool_tasks(true_probabilities(task_count, rng), rng)
    results = {
        name: run_sampler(sampling, tasks, groups, seed) for name, sampling in SAMPLERS.items()
    }
    run_seeds = 3 if quick else 10
    report: dict[str, Any] = {
        "tasks": task_count,
        "groups": groups,
        "group_size": GROUP_SIZE,
        "never_solved": NEVER_SOLVED,
        "always_solved": ALWAYS_SOLVED,
        "sampling": {
            name: {
                "uniform_share": round(result.uniform_share, 3),
                "uniform_share_second_half": round(result.uniform_share_second_half, 3),
                "origin_shares": {o: round(s, 3) for o, s in result.origin_shares().items()},
                "retired": result.retired,
            }
            for name, result in results.items()
        },
        "uniform_share_uniform": round(results["uniform"].uniform_share, 3),
        "uniform_share_dynamic": round(results["dynamic"].uniform_share, 3),
        "uniform_share_learnability": round(results["learnability"].uniform_share, 3),
        "default_run": {
            "tasks": RUN_TASKS,
            "groups": RUN_GROUPS,
            "never_solved": RUN_NEVER,
            "always_solved": RUN_ALWAYS,
            "seeds": run_seeds,
            "uniform_share": run_sized(run_seeds),
        },
    }
    print_table(report)
    return report


def print_table(report: dict[str, Any]) -> None:
    tables.print_table(
        f"{report['tasks']} tasks ({report['never_solved']:.0%} never solved, "
        f"{report['always_solved']:.0%} always solved), {report['groups']} groups of "
        f"{report['group_size']}",
        ("sampler", "uniform groups", "2nd half", "retired", "origins drawn"),
        [
            (
                name,
                f"{row['uniform_share']:.3f}",
                f"{row['uniform_share_second_half']:.3f}",
                row["retired"],
                " ".join(f"{o}={s:.2f}" for o, s in row["origin_shares"].items()),
            )
            for name, row in report["sampling"].items()
        ],
        left=(0, 4),
    )
    run = report["default_run"]
    tables.print_table(
        f"a default run's regime: {run['tasks']} tasks ({run['never_solved']:.0%} never "
        f"solved, {run['always_solved']:.0%} always), {run['groups']} groups, "
        f"{run['seeds']} seeds",
        ("sampler", "uniform groups (mean)", "least", "most"),
        [
            (name, f"{row['mean']:.3f}", f"{row['min']:.3f}", f"{row['max']:.3f}")
            for name, row in run["uniform_share"].items()
        ],
        left=(0,),
    )
