"""A run's accepted tasks beside the parent turns they were made from, ready for a hand label.

One row per task the judge accepted with a parent: the parent's request (its last user
turn) and ground-truth calls, what the policy got wrong there, the task's request and
calls, whether it calls a function the policy got wrong (``shares_failed_function``),
whether it makes two or more calls, how it was made (``made_by``), whether it calls the
very functions of its parent turn, its synthesis depth, and ``label`` and ``reason`` left
empty for a reader to fill in ("sensible" or "not sensible", one line why).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from coevolve.report.run_data import POOL_FILE, readable_pool
from coevolve.shared.failures import call_text, describe_failure
from coevolve.shared.messages import Lineage, Task, ToolCall

ACCEPTED_FILE = "accepted.json"


def _calls(turns: list[list[ToolCall]]) -> list[str]:
    return [call_text(call) for turn in turns for call in turn]


def made_by(lineage: Lineage) -> str:
    """How a task was made: by code from validated turns (``composed`` joins turns,
    ``substituted`` swaps a value, ``state_variant`` moves a turn to another initial state)
    or written by the abstractor from an exploration (``abstractor``)."""
    if lineage.composed_from:
        return "composed"
    if lineage.replaced is not None:
        return "substituted"
    if lineage.varied_state:
        return "state_variant"
    return "abstractor"


def accepted_row(task: Task, parent: Task | None) -> dict[str, Any]:
    """The row of one accepted task (``parent``: None when the pool does not hold it)."""
    lineage = task.lineage or Lineage()
    calls = _calls(task.ground_truth)
    targets = set(lineage.target_functions)
    parent_turn = len(parent.user_turns) - 1 if parent is not None else -1
    parent_truth = (
        parent.ground_truth[parent_turn : parent_turn + 1]
        if parent is not None and parent.ground_truth
        else []
    )
    names = [call.name for turn in task.ground_truth for call in turn]
    return {
        "task_id": task.id,
        "origin": task.origin,
        "signal_kind": lineage.signal_kind,
        "parent_id": lineage.parent_task_id,
        "parent_request": parent.user_turns[parent_turn] if parent is not None else None,
        "parent_calls": _calls(parent_truth),
        "policy_failed": [describe_failure(failed) for failed in lineage.failed_calls],
        "request": task.user_turns[-1] if task.user_turns else "",
        "calls": calls,
        "shares_failed_function": (
            any(call.name in targets for turn in task.ground_truth for call in turn)
            if targets
            else None
        ),
        "two_or_more_calls": len(calls) >= 2,
        "made_by": made_by(lineage),
        "same_functions_as_parent": (
            names == [call.name for turn in parent_truth for call in turn]
            if parent is not None
            else None
        ),
        "depth": lineage.depth,
        "label": None,
        "reason": None,
    }


def accepted_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every accepted task with a parent in the run's pool, in the order they joined it."""
    path = run_dir / POOL_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: no pool to read accepted tasks from")
    with readable_pool(path) as db:
        accepted = [
            msgspec.json.decode(task, type=Task)
            for (task,) in db.execute(
                "SELECT task FROM verdicts WHERE accepted ORDER BY created_at"
            ).fetchall()
        ]
        parent_ids = sorted(
            {t.lineage.parent_task_id for t in accepted if t.lineage and t.lineage.parent_task_id}
        )
        parents: dict[str, Task] = {}
        if parent_ids:
            rows = db.execute(
                "SELECT id, user_turns, ground_truth, environment FROM tasks WHERE id IN "
                f"({', '.join('?' for _ in parent_ids)})",
                parent_ids,
            ).fetchall()
            for task_id, turns, truth, environment in rows:
                parents[task_id] = msgspec.convert(
                    {
                        "id": task_id,
                        "environment": environment,
                        "user_turns": json.loads(turns),
                        "ground_truth": json.loads(truth),
                    },
                    Task,
                )
    return [
        accepted_row(task, parents.get(task.lineage.parent_task_id or ""))
        for task in accepted
        if task.lineage and task.lineage.parent_task_id
    ]


def accepted_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of the rows: how many, how many share a failed function, make 2+ calls,
    call just their parent turn's functions, and how many each way of making made."""
    known = [r for r in rows if r["shares_failed_function"] is not None]
    return {
        "accepted_with_parent": len(rows),
        "shares_failed_function": sum(bool(r["shares_failed_function"]) for r in known),
        "failure_known": len(known),
        "two_or_more_calls": sum(r["two_or_more_calls"] for r in rows),
        "same_functions_as_parent": sum(bool(r["same_functions_as_parent"]) for r in rows),
        "made_by": dict(Counter(r["made_by"] for r in rows).most_common()),
    }


def write_accepted_rows(rows: list[dict[str, Any]], out: Path) -> Path:
    """Write ``out`` (a JSON object: ``summary`` and ``accepted``, the rows)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"summary": accepted_summary(rows), "accepted": rows}, indent=2) + "\n"
    )
    return out
