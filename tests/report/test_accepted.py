"""``coevolve report``'s accepted tasks beside their parents, read from a pool written by
the pool-store's own store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coevolve.report.accepted import ACCEPTED_FILE, accepted_rows
from coevolve.report.run_report import render_run_report
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared import messages as m
from tests.report.conftest import T0, make_task

FAILED = m.FailedCall(
    expected=m.ToolCall(name="mv", arguments={"source": "report_0.txt"}),
    problem="wrong_function",
    got=m.ToolCall(name="cp", arguments={"source": "report_0.txt"}),
)


def synthesized(
    number: int, calls: list[m.ToolCall], accepted: bool = True, **made: Any
) -> m.Verdict:
    lineage = m.Lineage(
        signal_kind="boundary",
        parent_task_id="task-0",
        depth=1,
        failed_calls=[FAILED],
        target_functions=["mv"],
        **made,
    )
    task = m.Task(
        id=f"child-{number}",
        environment="bfcl",
        user_turns=[f"Request {number}."],
        ground_truth=[calls],
        origin="synthesized",
        lineage=lineage,
    )
    return m.Verdict(
        candidate_id=f"cand-{number}",
        accepted=accepted,
        reasons=[] if accepted else ["not about its functions"],
        task=task,
        created_at=T0 + number,
    )


def test_accepted_rows_pair_each_task_with_its_parent_and_what_it_failed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mv = m.ToolCall(name="mv", arguments={"source": "notes.txt"})
    ls = m.ToolCall(name="ls", arguments={})
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(0, created_at=0.0)])
        store.record_verdict(synthesized(1, [ls, mv], composed_from=["task-9", "task-0"]))
        store.record_verdict(synthesized(2, [ls]))
        store.record_verdict(synthesized(3, [mv], accepted=False))
        store.record_verdict(synthesized(4, [mv], replaced=["report_0.txt", "notes.txt"]))

    rows = accepted_rows(run)

    # the refused one is not a row
    assert [r["task_id"] for r in rows] == ["child-1", "child-2", "child-4"]
    first, second, _ = rows
    assert first["parent_request"] == "Move report_0.txt into the archive folder."
    assert first["parent_calls"] == ['mv(source="report_0.txt")']
    assert first["policy_failed"] == [
        'it called cp(source="report_0.txt") where mv(source="report_0.txt") was needed '
        "(wrong function)"
    ]
    assert first["calls"] == ["ls()", 'mv(source="notes.txt")']
    assert first["shares_failed_function"] is True and first["two_or_more_calls"] is True
    assert second["shares_failed_function"] is False and second["two_or_more_calls"] is False
    assert first["label"] is None and first["reason"] is None
    assert [r["made_by"] for r in rows] == ["composed", "abstractor", "substituted"]
    assert [r["same_functions_as_parent"] for r in rows] == [False, False, True]

    report = render_run_report(run, tmp_path / "report").read_text()
    assert (
        "Accepted tasks with a parent: 3; 2 of the 3 whose parent's failure is recorded call "
        "a function the policy got wrong there; 1 make two or more calls; 1 call just their "
        "parent turn's functions. Made by: 1 composed, 1 abstractor, 1 substituted." in report
    )
    written = json.loads((tmp_path / "report" / ACCEPTED_FILE).read_text())
    assert written["accepted"] == rows and written["summary"]["accepted_with_parent"] == 3
