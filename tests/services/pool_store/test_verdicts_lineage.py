"""Verdicts, accepted tasks and their lineage chain, plus the documented SQL queries."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import duckdb

from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import (
    RolloutResults,
    ScoreSample,
    Task,
    Verdict,
)
from tests.support.messages import EXPLORATION_CONTEXT as CONTEXT
from tests.support.messages import GUIDED_TRACE_ID, guided_lineage

TaskFactory = Callable[..., Task]
DOCS = Path(__file__).resolve().parents[3] / "docs" / "pool-store.md"


def candidate_verdict(make_task: TaskFactory, accepted: bool, **task_fields: object) -> Verdict:
    lineage = guided_lineage(
        signal_evidence={"rewards": [0.0, 1.0, 1.0, 0.0]}, parent_task_id="seed-task-3"
    )
    task = make_task(origin="explored", lineage=lineage, **task_fields)
    return Verdict(
        candidate_id=lineage.candidate_id,
        accepted=accepted,
        reasons=["ground truth replays and reaches the final state"]
        if accepted
        else ["final result: file still present"],
        criteria={
            "api_matching": True,
            "parameters": True,
            "logical_flow": True,
            "final_result": accepted,
            "no_failed_steps": True,
        },
        task=task,
    )


def test_accepted_verdict_adds_task_with_lineage_chain(
    store: PoolStore, make_task: TaskFactory
) -> None:
    verdict = candidate_verdict(make_task, accepted=True)
    assert store.record_verdict(verdict) == (True, verdict.task.id)

    stored = store.get_task(verdict.task.id)
    assert stored is not None
    assert stored.origin == "explored"
    assert stored.lineage.verdict_id == verdict.id
    assert stored.lineage.context == CONTEXT

    chain = store.lineage(verdict.task.id)
    assert chain["trace_id"] == GUIDED_TRACE_ID
    assert chain["signal"] == {
        "id": "sig-1",
        "kind": "boundary",
        "evidence": {"rewards": [0.0, 1.0, 1.0, 0.0]},
        "parent_task_id": "seed-task-3",
    }
    assert chain["context"]["failure_cause"] == CONTEXT.failure_cause
    assert chain["exploration"] == {"id": "exp-1", "mode": "guided", "steps": 3}
    assert chain["candidate"] == {"id": "cand-1"}
    assert chain["verdict"]["id"] == verdict.id
    assert chain["verdict"]["accepted"] is True
    assert chain["verdict"]["criteria"]["final_result"] is True


def test_duplicate_verdict_makes_one_row(
    store: PoolStore, make_task: TaskFactory, db_path: Path
) -> None:
    verdict = candidate_verdict(make_task, accepted=True)
    assert store.record_verdict(verdict) == (True, verdict.task.id)
    # the redelivery reports the task it added, so task-added can be republished
    assert store.record_verdict(verdict) == (False, verdict.task.id)
    stats = store.stats()
    assert stats.accepted_candidates == 1
    assert stats.tasks_by_origin["explored"] == 1
    store.close()
    with duckdb.connect(str(db_path), read_only=True) as connection:
        assert connection.execute("SELECT count(*) FROM verdicts").fetchall() == [(1,)]
        assert connection.execute("SELECT count(*) FROM tasks").fetchall() == [(1,)]


def test_rejected_verdict_is_stored_without_task(store: PoolStore, make_task: TaskFactory) -> None:
    verdict = candidate_verdict(make_task, accepted=False)
    assert store.record_verdict(verdict) == (True, None)
    assert store.get_task(verdict.task.id) is None
    assert store.lineage(verdict.task.id) == {}
    stats = store.stats()
    assert (stats.accepted_candidates, stats.rejected_candidates) == (0, 1)
    assert sum(stats.tasks_by_origin.values()) == 0


def test_accepted_duplicate_content_adds_nothing(store: PoolStore, make_task: TaskFactory) -> None:
    existing = make_task(origin="seed")
    store.add_tasks([existing])
    verdict = candidate_verdict(make_task, accepted=True, user_turns=existing.user_turns)
    assert store.record_verdict(verdict) == (True, None)
    assert store.stats().accepted_candidates == 1
    assert store.stats().tasks_by_origin == {"seed": 1, "explored": 0, "synthesized": 0}


def test_seed_task_lineage_is_empty_chain(store: PoolStore, make_task: TaskFactory) -> None:
    seed = make_task()
    store.add_tasks([seed])
    chain = store.lineage(seed.id)
    assert chain["task_id"] == seed.id
    assert chain["origin"] == "seed"
    assert [chain[k] for k in ("signal", "context", "exploration", "candidate", "verdict")] == [
        None
    ] * 5


def test_documented_queries_run_on_a_populated_file(db_path: Path, make_task: TaskFactory) -> None:
    accepted = candidate_verdict(make_task, accepted=True)
    with PoolStore(db_path) as store:
        store.add_tasks([make_task() for _ in range(3)])
        store.record_verdict(accepted)
        store.record_verdict(candidate_verdict(make_task, accepted=False))
        store.record_results(
            RolloutResults(
                group_id="g",
                samples=[
                    ScoreSample(task_id=accepted.task.id, policy_version=1, score=i % 2, length=50)
                    for i in range(8)
                ],
            )
        )
    queries = re.findall(r"```sql\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    assert len(queries) >= 8
    with duckdb.connect(str(db_path), read_only=True) as connection:
        for query in queries:
            body = query.strip().rstrip(";").replace("TASK_ID", accepted.task.id)
            # count(*) around the query runs it fully without converting timestamps in Python
            row = connection.execute(f"SELECT count(*) FROM ({body})").fetchone()
            assert row is not None and row[0] > 0, query
