"""Benchmark of pool-store: sampling 64 tasks from a large pool, and the write paths.

``run(quick)`` builds a pool of 1,000,000 tasks (100,000 with ``quick``) straight in SQL,
then measures, in the same run, p50/p99 of ``PoolStore.sample_batch(64)`` with a mix,
with a mix and an environment filter, and next to them a naive full-scan draw
(``ORDER BY random()``) as the reference; then ``record_results`` and ``add_tasks``.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from coevolve.bench import tables
from coevolve.services.pool_store.schema import origin_key_range
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import (
    Lineage,
    RolloutResults,
    ScoreSample,
    Task,
    ToolCall,
    Verdict,
)

BATCH = 64
SAMPLES = 200
WARMUP = 5
BASELINE_SAMPLES = 30
MIX = {"seed": 0.5, "explored": 0.3, "synthesized": 0.2}
ORIGIN_SHARES = {"seed": 0.6, "explored": 0.3, "synthesized": 0.1}


def build_pool(path: Path, total: int) -> None:
    """Fill a fresh pool file with ``total`` synthetic tasks in bulk SQL.

    Rows look like small BFCL tasks; every 10th is in environment ``toy`` and 1 in 100
    is retired, so sampling meets both filters.
    """
    PoolStore(path).close()
    with duckdb.connect(str(path)) as connection:
        connection.execute("SET enable_progress_bar = false")
        for origin, share in ORIGIN_SHARES.items():
            low, _ = origin_key_range(origin)
            connection.execute(
                f"""
                INSERT INTO tasks
                SELECT '{origin}-' || i,
                       sha256('{origin}-' || i),
                       CASE WHEN i % 10 = 0 THEN 'toy' ELSE 'bfcl' END,
                       json_array('Move report_' || i || '.txt into the archive folder.',
                                  'Then show me what is in the archive.'),
                       json_object('GorillaFileSystem', json_object('root', json_object(
                           'workspace',
                           json_object('report_' || i || '.txt', 'quarterly numbers')))),
                       json_array(
                           json_array(json_object('name', 'mv', 'arguments', json_object(
                               'source', 'report_' || i || '.txt', 'destination', 'archive'))),
                           json_array(json_object('name', 'ls', 'arguments', json_object()))),
                       json_object('involved_classes', json_array('GorillaFileSystem')),
                       '{origin}',
                       'archive a report and list the archive',
                       NULL,
                       '{{}}',
                       CASE WHEN i % 100 = 1 THEN 'retired' ELSE 'active' END,
                       epoch(now()) + i / 1000.0,
                       {low} + i
                FROM range(?) AS r(i)
                """,
                [round(total * share)],
            )
        connection.execute("CHECKPOINT")


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99_index = min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[p99_index] * 1000, 2),
    }


def timed(call: Callable[[int], object], count: int, warmup: int = WARMUP) -> list[float]:
    for i in range(warmup):
        call(-1 - i)
    seconds = []
    for i in range(count):
        start = time.perf_counter()
        call(i)
        seconds.append(time.perf_counter() - start)
    return seconds


def naive_sample(path: Path, seed: int) -> int:
    """The reference: per origin, ``ORDER BY random() LIMIT quota`` over the whole table."""
    rng = random.Random(seed)
    quotas = Counter(rng.choices(list(MIX), weights=list(MIX.values()), k=BATCH))
    rows = 0
    with duckdb.connect(str(path), read_only=True) as connection:
        connection.execute("SET enable_progress_bar = false")
        for origin, quota in quotas.items():
            rows += len(
                connection.execute(
                    "SELECT * FROM tasks WHERE origin = ? AND status = 'active' "
                    "ORDER BY random() LIMIT ?",
                    [origin, quota],
                ).fetchall()
            )
    return rows


def write_paths(store: PoolStore) -> dict[str, Any]:
    def record(i: int) -> None:
        samples = [
            ScoreSample(task_id=f"seed-{i * 8 + k + 10}", policy_version=1, score=k % 2, length=300)
            for k in range(8)
        ]
        store.record_results(RolloutResults(group_id=f"bench-group-{i}", samples=samples))

    def judge(i: int) -> None:
        task = Task(
            id=f"bench-judged-{i}",
            environment="bfcl",
            user_turns=[f"Rename notes_{i}.txt to done_{i}.txt."],
            ground_truth=[[ToolCall(name="mv", arguments={"source": f"notes_{i}.txt"})]],
            origin="explored",
            lineage=Lineage(signal_id=f"signal-{i}", signal_kind="boundary", trace_id="t" * 32),
        )
        verdict = Verdict(candidate_id=f"candidate-{i}", accepted=True, reasons=["ok"], task=task)
        assert store.record_verdict(verdict)[1] == task.id

    results = percentiles(timed(record, SAMPLES))
    verdicts = percentiles(timed(judge, SAMPLES))
    new_tasks = [
        Task(
            id=f"bench-new-{i}",
            environment="bfcl",
            user_turns=[f"Copy draft_{i}.md to the backup folder."],
            ground_truth=[[ToolCall(name="cp", arguments={"source": f"draft_{i}.md"})]],
            origin="synthesized",
        )
        for i in range(1000)
    ]
    start = time.perf_counter()
    added, _ = store.add_tasks(new_tasks)
    add_seconds = time.perf_counter() - start
    assert len(added) == len(new_tasks)
    return {
        "record_results": results,
        "record_verdict": verdicts,
        "add_1000_tasks_s": round(add_seconds, 3),
    }


def run(quick: bool) -> dict[str, Any]:
    total = 100_000 if quick else 1_000_000
    with tempfile.TemporaryDirectory(prefix="coevolve-bench-pool-") as tmp:
        path = Path(tmp) / "pool.duckdb"
        start = time.perf_counter()
        build_pool(path, total)
        build_seconds = time.perf_counter() - start
        file_mb = path.stat().st_size / 1e6

        baseline = percentiles(timed(lambda i: naive_sample(path, i), BASELINE_SAMPLES, 1))
        with PoolStore(path) as store:
            for seed in range(3):
                assert len(store.sample_batch(BATCH, MIX, seed=seed)) == BATCH
            mixed = percentiles(timed(lambda i: store.sample_batch(BATCH, MIX, seed=i), SAMPLES))
            filtered = percentiles(
                timed(lambda i: store.sample_batch(BATCH, MIX, environment="bfcl", seed=i), SAMPLES)
            )
            writes = write_paths(store)

    report: dict[str, Any] = {
        "tasks": total,
        "build_s": round(build_seconds, 2),
        "file_mb": round(file_mb, 1),
        "batch": BATCH,
        "samples": SAMPLES,
        "sample_mix": mixed,
        "sample_mix_environment": filtered,
        "naive_order_by_random": baseline | {"samples": BASELINE_SAMPLES},
        "speedup_p50": round(baseline["p50_ms"] / mixed["p50_ms"], 1),
        **writes,
    }
    print_table(report)
    return report


def print_table(report: dict[str, Any]) -> None:
    rows = [
        ("sample_batch(64, mix)", report["sample_mix"]),
        ("sample_batch(64, mix, environment)", report["sample_mix_environment"]),
        ("naive ORDER BY random() (reference)", report["naive_order_by_random"]),
        ("record_results (group of 8)", report["record_results"]),
        ("record_verdict (accepted, adds a task)", report["record_verdict"]),
    ]
    tables.print_table(
        f"pool: {report['tasks']:,} tasks, built in {report['build_s']} s, "
        f"file {report['file_mb']} MB; mix {MIX}",
        ("operation", "p50 ms", "p99 ms"),
        [(name, f"{n['p50_ms']:.2f}", f"{n['p99_ms']:.2f}") for name, n in rows],
        note=f"add_tasks(1000 tasks): {report['add_1000_tasks_s']} s\n"
        f"sampling speed-up over the naive draw (p50): {report['speedup_p50']}x",
    )


if __name__ == "__main__":
    import sys

    run(quick="--quick" in sys.argv)
