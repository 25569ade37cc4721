"""The report's hard-negative comparison: each failure-agent failure against the target's
failures on the same task."""

from __future__ import annotations

from pathlib import Path

import pytest

from coevolve.report.hard_negatives import hard_negatives, hard_negatives_text
from coevolve.report.run_data import GroupRow, RunData, StepGroup, StepRecord


def failure_group(name: str, task: str, rewards: tuple[float, ...]) -> StepGroup:
    return StepGroup(name, task, "seed", 2, uniform=False, agent="failure", rewards=rewards)


def test_each_failure_agent_failure_is_set_against_the_targets_failures_of_its_task(
    tmp_path: Path,
) -> None:
    data = RunData(run_dir=tmp_path)
    data.groups = [
        GroupRow(0.0, 1, 0.5, False, task_id="a", scores=(1.0, 0.2, 0.0)),  # failures 0.2, 0
        GroupRow(1.0, 1, 0.4, False, task_id="a", scores=(0.4,)),  # a's mean failure: 0.2
        GroupRow(2.0, 1, 0.3, False, task_id="b", scores=(0.3, 0.3)),
        GroupRow(3.0, 1, 1.0, True, task_id="c", scores=(1.0, 1.0)),  # c never failed
    ]
    target_group = StepGroup("t", "a", "seed", 1, uniform=False)
    data.steps = [
        StepRecord(1, 2, True, 0.0, (target_group, failure_group("f1", "a", (0.6, 1.0, 0.4))), ()),
        StepRecord(2, 3, True, 9.0, (failure_group("f2", "b", (0.5,)),), ()),
        StepRecord(3, 4, True, 19.0, (failure_group("f3", "c", (0.2,)),), ()),
    ]

    found = hard_negatives(data)

    # a: 0.6 and 0.4 against 0.2 (its solve is not a failure); b: 0.5 against 0.3; c: none
    assert found is not None and (found.pairs, found.tasks) == (3, 2)
    assert found.failure_agent_mean == pytest.approx(0.5)
    assert found.target_mean == pytest.approx((0.2 + 0.2 + 0.3) / 3)
    assert found.gap == pytest.approx((0.4 + 0.2 + 0.2) / 3)
    assert found.low <= found.gap <= found.high
    assert "3 failures of the failure agent on 2 tasks" in hard_negatives_text(found)
    assert hard_negatives(RunData(run_dir=tmp_path)) is None
