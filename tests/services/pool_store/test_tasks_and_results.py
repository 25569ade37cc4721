"""Tasks, rollout results, idempotency and persistence on a real DuckDB file."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest

from coevolve.services.pool_store.store import PoolStore, ReadOnlyStoreError, Transaction
from coevolve.shared.messages import (
    RolloutResults,
    ScoreSample,
    Task,
    ToolCall,
)
from tests.support.messages import guided_lineage

TaskFactory = Callable[..., Task]


def count_rows(path: Path, table: str) -> int:
    with duckdb.connect(str(path), read_only=True) as connection:
        row = connection.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def test_task_round_trips_every_field(store: PoolStore, make_task: TaskFactory) -> None:
    task = make_task(
        origin="explored",
        user_turns=["List the files.", "Now delete notes.txt."],
        ground_truth=[
            [ToolCall(name="ls", arguments={"a": True})],
            [ToolCall(name="rm", arguments={"file_name": "notes.txt"})],
        ],
        description="list then delete",
        source_entry="multi_turn_base_7",
        lineage=guided_lineage(
            signal_kind="rare", signal_evidence={"pattern": "rm", "share": 0.01}
        ),
        created_at=1_700_000_000.123456,
    )
    store.add_tasks([task])
    assert store.get_task(task.id) == task
    assert store.get_task("no-such-task") is None


def test_duplicate_tasks_make_one_row(
    store: PoolStore, make_task: TaskFactory, db_path: Path
) -> None:
    first = make_task()
    same_content_new_id = make_task(user_turns=first.user_turns, created_at=first.created_at + 5)
    other = make_task()
    added, duplicates = store.add_tasks([first, same_content_new_id, other])
    assert added == [first.id, other.id]
    assert duplicates == [same_content_new_id.id]
    added_again, duplicates_again = store.add_tasks([first, other])
    assert added_again == []
    assert duplicates_again == [first.id, other.id]
    store.close()
    assert count_rows(db_path, "tasks") == 2


def test_id_taken_by_other_content_rejects_whole_call(
    store: PoolStore, make_task: TaskFactory
) -> None:
    original = make_task()
    store.add_tasks([original])
    innocent = make_task()
    clash = make_task(id=original.id)
    with pytest.raises(ValueError, match="already names a different task"):
        store.add_tasks([innocent, clash])
    assert store.get_task(innocent.id) is None
    assert store.get_task(original.id) == original


def test_duplicate_results_make_one_row(store: PoolStore, db_path: Path) -> None:
    samples = [
        ScoreSample(
            task_id="task-a",
            policy_version=3,
            score=score,
            length=100 + i,
            generate_s=0.5,
            environment_s=0.1,
        )
        for i, score in enumerate([1.0, 0.0, 0.5])
    ]
    results = RolloutResults(group_id="group-1", samples=samples)
    assert store.record_results(results) is True
    assert store.record_results(results) is False
    republished = RolloutResults(group_id="group-1", samples=samples)
    assert republished.id != results.id
    assert store.record_results(republished) is False
    assert store.processed(results.id)
    assert store.stats().results == 3
    store.close()
    assert count_rows(db_path, "rollout_results") == 3


def test_score_history_in_recording_order(store: PoolStore) -> None:
    for version, score in enumerate([0.0, 0.25, 1.0]):
        store.record_results(
            RolloutResults(
                group_id=f"group-{version}",
                samples=[
                    ScoreSample(task_id="task-a", policy_version=version, score=score, length=10),
                    ScoreSample(
                        task_id="task-b", policy_version=version, score=1 - score, length=20
                    ),
                ],
            )
        )
    history = store.score_history("task-a")
    assert [(s.policy_version, s.score, s.length) for s in history] == [
        (0, 0.0, 10),
        (1, 0.25, 10),
        (2, 1.0, 10),
    ]
    assert store.score_history("unknown") == []


def test_data_survives_reopen(db_path: Path, make_task: TaskFactory) -> None:
    tasks = [make_task(origin=origin) for origin in ("seed", "seed", "explored", "synthesized")]
    results = RolloutResults(
        group_id="g",
        samples=[ScoreSample(task_id=tasks[0].id, policy_version=1, score=1.0, length=7)],
    )
    with PoolStore(db_path) as store:
        store.add_tasks(tasks)
        store.record_results(results)
        before = store.stats()
    with PoolStore(db_path) as reopened:
        assert [reopened.get_task(t.id) for t in tasks] == tasks
        assert (
            reopened.stats().tasks_by_origin
            == before.tasks_by_origin
            == {"seed": 2, "explored": 1, "synthesized": 1}
        )
        assert reopened.score_history(tasks[0].id) == results.samples
        assert reopened.record_results(results) is False
        # sequence numbers continue after a restart, so new tasks stay sampleable
        late = make_task(origin="seed")
        reopened.add_tasks([late])
        drawn = {t.id for t in reopened.sample_batch(3, {"seed": 1.0}, seed=0)}
        assert drawn == {tasks[0].id, tasks[1].id, late.id}


def test_read_only_open_reads_and_refuses_writes(db_path: Path, make_task: TaskFactory) -> None:
    task = make_task()
    with PoolStore(db_path) as store:
        store.add_tasks([task])
    with PoolStore.open_readonly(db_path) as reader:
        assert reader.get_task(task.id) == task
        assert reader.stats().tasks_by_origin["seed"] == 1
        with pytest.raises(ReadOnlyStoreError):
            reader.add_tasks([make_task()])
    with pytest.raises(FileNotFoundError):
        PoolStore.open_readonly(db_path.parent / "missing.duckdb")


def test_second_writer_in_one_process_is_refused(store: PoolStore, db_path: Path) -> None:
    with pytest.raises(RuntimeError, match="already open for writing"):
        PoolStore(db_path)
    store.close()
    PoolStore(db_path).close()


def test_newer_schema_is_refused(db_path: Path) -> None:
    PoolStore(db_path).close()
    with duckdb.connect(str(db_path)) as connection:
        connection.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(ValueError, match="newer than supported"):
        PoolStore(db_path)


def test_run_once_commits_effect_and_mark_together(
    store: PoolStore, make_task: TaskFactory
) -> None:
    calls: list[str] = []

    def effect(tx: Transaction) -> int:
        calls.append("ran")
        rows = tx.execute("SELECT count(*) FROM tasks")
        return int(rows[0][0])

    assert store.run_once("msg-1", "test", effect) == (True, 0)
    assert store.run_once("msg-1", "test", effect) == (False, None)
    assert calls == ["ran"]

    def failing(tx: Transaction) -> None:
        tx.execute("INSERT INTO meta VALUES ('marker', 'x')")
        raise RuntimeError("handler failed after writing")

    with pytest.raises(RuntimeError):
        store.run_once("msg-2", "test", failing)
    assert not store.processed("msg-2")
    assert store.run_once(
        "msg-2", "test", lambda tx: tx.execute("SELECT value FROM meta WHERE key = 'marker'")
    ) == (True, [])


def test_list_tasks_newest_first_and_status(store: PoolStore, make_task: TaskFactory) -> None:
    tasks = [
        make_task(origin=o, created_at=1000.0 + i)
        for i, o in enumerate(["seed", "explored", "seed"])
    ]
    store.add_tasks(tasks)
    assert [t.id for t in store.list_tasks()] == [t.id for t in reversed(tasks)]
    assert [t.id for t in store.list_tasks(origin="seed", limit=1)] == [tasks[2].id]
    assert store.set_status([tasks[0].id, tasks[0].id, "unknown"], "retired") == 1
    assert store.set_status([tasks[0].id], "retired") == 0
    retired = store.get_task(tasks[0].id)
    assert retired is not None and retired.status == "retired"


def test_concurrent_threads_share_one_store(store: PoolStore, make_task: TaskFactory) -> None:
    batches = [[make_task(origin="seed") for _ in range(20)] for _ in range(4)]
    errors: list[BaseException] = []

    def worker(batch: list[Task]) -> None:
        try:
            store.add_tasks(batch)
            for _ in range(5):
                store.sample_batch(8)
            store.record_results(
                RolloutResults(
                    group_id=batch[0].id,
                    samples=[
                        ScoreSample(task_id=batch[0].id, policy_version=0, score=1.0, length=1)
                    ],
                )
            )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.stats().tasks_by_origin["seed"] == 80
    assert store.stats().results == 4
    drawn = store.sample_batch(80, seed=1)
    assert len({t.id for t in drawn}) == 80
