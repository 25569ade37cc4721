"""The learner's step record: one JSON line per GRPO step in RUN_DIR/learner/steps.jsonl."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec

from coevolve.services.learner.handler import (
    STEPS_FILE,
    append_step_record,
    record_step,
    step_record,
)
from coevolve.services.learner.step_metrics import StepMetrics
from tests.support.messages import rewarded_group


def metrics(step: int, version: int, trained: bool) -> StepMetrics:
    zeros = {f.name: 0 for f in dataclasses.fields(StepMetrics)}
    return StepMetrics(**{**zeros, "step": step, "version": version, "trained": trained})


GROUPS = [
    rewarded_group("g1", "task-a", "seed", 5, 0.0, 1.0),
    rewarded_group("g2", "task-b", "synthesized", 6, 1.0, 1.0),  # uniform: no gradient
    rewarded_group("g3", "task-c", "seed", 1, 0.0, 0.4),  # 5 versions behind v6: stale at 4
]


def test_a_record_names_each_trained_group_and_each_stale_one() -> None:
    record = step_record(
        GROUPS,
        step=3,
        version=7,
        published=True,
        version_before=6,
        max_staleness=4,
        at=1.5,
    )

    assert record == {
        "step": 3,
        "version": 7,
        "published": True,
        "time": 1.5,
        "groups": [
            {
                "group_id": "g1",
                "task_id": "task-a",
                "origin": "seed",
                "policy_version": 5,
                "reward_mean": 0.5,
                "uniform": False,
            },
            {
                "group_id": "g2",
                "task_id": "task-b",
                "origin": "synthesized",
                "policy_version": 6,
                "reward_mean": 1.0,
                "uniform": True,
            },
        ],
        "stale": [
            {
                "group_id": "g3",
                "task_id": "task-c",
                "origin": "seed",
                "policy_version": 1,
                "reward_mean": 0.2,
                "uniform": False,
            }
        ],
    }


def test_steps_append_one_line_each_and_a_restarted_learner_appends(tmp_path: Path) -> None:
    path = tmp_path / STEPS_FILE
    first = record_step(path, GROUPS[:1], metrics(1, 2, True), version_before=1, max_staleness=4)
    # a learner killed mid-write leaves a line without its end; the next record (after
    # the restart) starts a line of its own
    with path.open("ab") as handle:
        handle.write(b'{"step": 2, "vers')
    second = record_step(path, GROUPS, metrics(2, 7, True), version_before=6, max_staleness=4)
    append_step_record(path, {"step": 2, "version": 7, "published": False, "groups": []})

    lines = path.read_text().splitlines()
    assert len(lines) == 4
    assert json.loads(lines[0]) == first and json.loads(lines[2]) == second
    assert [g["task_id"] for g in second["groups"]] == ["task-a", "task-b"]
    assert [g["task_id"] for g in second["stale"]] == ["task-c"]
    assert second["published"] is True and first["version"] == 2
    assert json.loads(lines[3])["published"] is False


def test_the_report_reads_what_the_learner_writes(tmp_path: Path) -> None:
    from coevolve.report.run_data import read_steps

    path = tmp_path / STEPS_FILE
    record_step(path, GROUPS, metrics(4, 7, True), version_before=6, max_staleness=4)
    with path.open("ab") as handle:
        handle.write(b"not json\n")
    record_step(path, GROUPS[1:2], metrics(4, 7, False), version_before=7, max_staleness=4)

    steps = read_steps(path)
    assert [(s.step, s.version, s.published) for s in steps] == [(4, 7, True), (4, 7, False)]
    assert [(g.task_id, g.origin, g.uniform) for g in steps[0].groups] == [
        ("task-a", "seed", False),
        ("task-b", "synthesized", True),
    ]
    assert [(g.group_id, g.policy_version) for g in steps[0].stale] == [("g3", 1)]


def test_a_labelled_group_records_the_attributors_seconds() -> None:
    plain, labelled = (
        rewarded_group("g1", "a", "seed", 5, 0.0, 0.0),
        rewarded_group("g2", "b", "seed", 5, 0.0, 0.0),
    )
    labelled.label_s = 2.5
    labelled.trajectories[0].step_labels = [1]
    record = step_record(
        [plain, labelled], step=1, version=6, published=True, version_before=5, max_staleness=4
    )
    first, second = record["groups"]
    assert "label_s" not in first and "labelled" not in first
    assert (second["label_s"], second["labelled"]) == (2.5, 1)


def test_labels_and_navigated_trajectories_are_recorded_and_read_back(tmp_path: Path) -> None:
    labelled, navigated = (
        rewarded_group("g1", "a", "seed", 5, 1.0, 0.0),
        rewarded_group("g2", "b", "seed", 5, 1.0, 0.0),
    )
    labelled.label_s = 3.0
    labelled.trajectories[0].step_labels = [1, -1, 1]
    labelled.trajectories[1].step_labels = [-1]
    from coevolve.report.run_data import read_steps

    navigated.trajectories[0].experience_ids = ["exp-1"]
    path = tmp_path / STEPS_FILE
    record_step(path, [labelled, navigated], metrics(1, 6, True), version_before=5, max_staleness=4)
    (step,) = read_steps(path)
    first, second = step.groups
    assert (first.label_s, first.labelled, first.good, first.bad) == (3.0, 2, 2, 2)
    assert (first.navigated, second.navigated, second.labelled) == (0, 1, 0)


def test_a_failure_agent_group_is_recorded_with_its_agent_and_rewards() -> None:
    group = msgspec.structs.replace(
        rewarded_group("g4", "task-a", "seed", 5, 0.6, 0.2), agent="failure"
    )
    record = step_record(
        [GROUPS[0], group], step=1, version=2, published=True, version_before=5, max_staleness=4
    )

    target, failure = record["groups"]
    assert "agent" not in target and "rewards" not in target
    assert (failure["agent"], failure["rewards"]) == ("failure", [0.6, 0.2])
