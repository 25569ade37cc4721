"""``coevolve report``'s draws and repair sections, on a run directory written with the
real writers: the pool-store's own store, the learner's step record, the monitor's state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coevolve.cli import app
from coevolve.report import repair
from coevolve.report.repair import (
    MEASURED_FILE,
    NO_SIGNAL,
    MeasuredSample,
    aggregate_measured,
    child_rows,
    draw_rows,
    measure_repair,
    parent_groups,
    repair_task_sets,
)
from coevolve.report.run_data import load_run
from coevolve.report.run_report import render_run_report
from coevolve.services.learner.handler import STEPS_FILE
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared import messages as m
from tests.report.conftest import T0, make_task
from tests.support.learner_steps import record_step
from tests.support.messages import rewarded_group

# rollout groups: (task, policy version, scores)
ROLLOUTS: tuple[tuple[str, int, tuple[float, ...]], ...] = (
    ("task-0", 1, (0.0, 0.0, 0.0, 0.0)),
    ("task-0", 1, (0.0, 0.4, 0.0, 0.0)),
    ("task-0", 5, (1.0, 1.0, 0.0, 0.4)),
    ("task-1", 1, (0.0, 0.0, 0.0, 0.0)),
    ("task-2", 1, (0.0, 0.0, 0.0, 0.0)),
    ("task-2", 5, (0.0, 0.0, 0.0, 0.4)),
    ("task-4", 1, (1.0, 1.0, 1.0, 1.0)),
    ("task-4", 5, (1.0, 1.0, 1.0, 0.0)),
    ("task-10", 3, (0.0, 1.0, 0.0, 1.0)),
    ("task-10", 5, (0.0, 0.0, 0.0, 0.0)),
)


def child(number: int, parent: str, kind: m.SignalKind) -> m.Task:
    lineage = m.Lineage(signal_kind=kind, signal_id=f"sig-{number}", parent_task_id=parent, depth=1)
    return make_task(number, origin="synthesized", created_at=T0, lineage=lineage)


@pytest.fixture
def repair_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(i, created_at=0.0) for i in range(6)])
        for number, parent, kind, accepted in (
            (10, "task-0", "boundary", True),
            (11, "task-1", "rare", True),
            (12, "task-2", "rare", False),
        ):
            store.record_verdict(
                m.Verdict(
                    candidate_id=f"cand-{number}",
                    accepted=accepted,
                    reasons=[] if accepted else ["ground truth fails"],
                    task=child(number, parent, kind),
                    created_at=T0 + number,
                )
            )
        for index, (task_id, version, scores) in enumerate(ROLLOUTS):
            samples = [
                m.ScoreSample(task_id=task_id, policy_version=version, score=s, length=10)
                for s in scores
            ]
            store.record_results(m.RolloutResults(group_id=f"g{index}", samples=samples))
    state = run / "signal_monitor" / "state.json"
    state.parent.mkdir()
    raised = ("boundary:task-0", "rare:task-1", "rare:task-2", "uncertainty:task-3")
    state.write_text(
        json.dumps(
            {
                "emitted": {"boundary": 1, "rare": 2, "uncertainty": 1},
                "last_signal_at": {key: T0 for key in raised},
            }
        )
    )
    steps = run / STEPS_FILE
    for groups, (step, version, published, before) in (
        (
            [
                rewarded_group("s1", "task-0", "seed", 1, 0.0, 0.4, 0.0, 0.0),
                rewarded_group("s2", "task-4", "seed", 1, 1.0, 1.0, 1.0, 1.0),
            ],
            (1, 2, True, 1),
        ),
        (
            [
                rewarded_group("s3", "task-10", "synthesized", 2, 0.0, 1.0, 0.0, 1.0),
                rewarded_group("s4", "task-10", "synthesized", 2, 0.0, 0.0, 0.0, 0.0),
            ],
            (2, 3, True, 2),
        ),
        # all uniform: no update, so nothing trained on
        ([rewarded_group("s5", "task-10", "synthesized", 3, 1.0, 1.0, 1.0, 1.0)], (2, 3, False, 3)),
        (
            [
                rewarded_group("s6", "task-0", "seed", 4, 0.0, 1.0, 1.0, 0.4),
                rewarded_group("s7", "task-2", "seed", 1, 0.0, 0.0, 0.0, 0.0),  # 3 versions behind
            ],
            (3, 4, True, 4),
        ),
    ):
        record_step(
            steps,
            groups,
            step=step,
            versions=(before, version),
            at=T0 + 60 * step,
            published=published,
        )
    (run / "policies").mkdir()
    for version in (1, 2, 3, 4, 5):
        (run / "policies" / f"v{version}.safetensors").write_bytes(b"weights")
    return run


def test_draws_per_origin_with_the_largest_and_the_median_task(repair_run: Path) -> None:
    rows = {row.origin: row for row in draw_rows(load_run(repair_run))}

    assert list(rows) == ["seed", "synthesized", "all"]
    seed, synthesized, every = rows["seed"], rows["synthesized"], rows["all"]
    # seed: task-0 3 groups, task-1 1, task-2 2, task-4 2 (of 6 seed tasks)
    assert (seed.groups, seed.tasks_drawn, seed.tasks_in_pool) == (8, 4, 6)
    assert (seed.largest_task, seed.largest_groups, seed.median_groups) == ("task-0", 3, 2.0)
    assert (seed.largest_share, seed.median_share, seed.ratio) == (3 / 8, 2 / 8, 1.5)
    assert (synthesized.groups, synthesized.tasks_drawn, synthesized.tasks_in_pool) == (2, 1, 2)
    assert (synthesized.largest_task, synthesized.largest_share) == ("task-10", 1.0)
    assert (every.groups, every.tasks_drawn, every.tasks_in_pool) == (10, 5, 8)
    assert (every.largest_share, every.median_share) == (3 / 10, 2 / 10)
    # trained on: steps that updated the weights; in brackets, groups with a gradient
    assert (seed.trained, seed.trained_with_gradient, seed.stale) == (3, 2, 1)
    assert (synthesized.trained, synthesized.trained_with_gradient, synthesized.stale) == (2, 1, 0)
    assert (every.trained, every.trained_with_gradient, every.stale) == (5, 3, 1)


def test_repair_rows_name_parent_kind_training_and_the_parents_change(repair_run: Path) -> None:
    rows = child_rows(load_run(repair_run))

    assert [(r.child, r.parent, r.kind, r.depth) for r in rows] == [
        ("task-10", "task-0", "boundary", 1),
        ("task-11", "task-1", "rare", 1),
    ]
    boundary, rare = rows
    assert (boundary.child_groups, boundary.trained, boundary.trained_with_gradient) == (2, 2, 1)
    assert (rare.child_groups, rare.trained, rare.trained_with_gradient) == (0, 0, 0)
    change = boundary.parent_change
    assert change is not None and change.after is not None
    assert (change.before.version, change.before.samples, change.before.solved) == (1, 8, 0)
    assert change.before.mean == pytest.approx(0.05)
    assert (change.after.version, change.after.samples, change.after.solved) == (5, 4, 2)
    assert change.after.mean == pytest.approx(0.6)
    assert change.change == pytest.approx(0.55)
    # task-1 was rolled out at v1 only: no after
    assert rare.parent_change is not None and rare.parent_change.after is None


def test_parents_by_kind_beside_tasks_without_a_child_and_without_a_signal(
    repair_run: Path,
) -> None:
    groups, source = parent_groups(load_run(repair_run))

    assert source.source == "signal_monitor/state.json"
    summary = {g.label: (g.tasks, len(g.paired), g.mean_change) for g in groups}
    assert list(summary) == [
        "boundary: parents of accepted tasks",
        "rare: parents of accepted tasks",
        "raised a signal, no accepted child",
        NO_SIGNAL,
    ]
    assert summary["boundary: parents of accepted tasks"] == (1, 1, pytest.approx(0.55))
    assert summary["rare: parents of accepted tasks"] == (1, 0, None)
    assert summary["raised a signal, no accepted child"] == (2, 1, pytest.approx(0.1))  # 2, 3
    assert summary[NO_SIGNAL] == (2, 1, pytest.approx(-0.25))  # task-4 and task-5
    quiet = groups[-1]
    assert quiet.pooled("before") == (4, 1.0, 1.0)
    assert quiet.pooled("after") == (4, 0.75, 0.75)


def test_without_the_monitors_record_the_parents_of_candidates_stand_in(
    repair_run: Path,
) -> None:
    (repair_run / "signal_monitor" / "state.json").unlink()
    groups, source = parent_groups(load_run(repair_run))

    assert source.source == "the parents of judged candidates"
    summary = {g.label: g.tasks for g in groups}
    assert summary["parent of a candidate, none accepted"] == 1  # task-2
    assert summary[NO_SIGNAL] == 3  # task-3, task-4, task-5


def test_report_renders_the_draws_and_repair_tables(repair_run: Path, tmp_path: Path) -> None:
    text = render_run_report(repair_run, tmp_path / "report").read_text()
    draws = text.split("## Draws")[1].split("## Verdicts")[0]
    repaired = text.split("## Repair")[1].split("## Time per stage")[0]

    assert (
        "| seed | 8 | 4 / 6 | `task-0`: 3 groups (37.5%) | 2 groups (25.0%) | 1.5x | 3 (2) | 1 |"
        in draws
    )
    assert (
        "| synthesized | 2 | 1 / 2 | `task-10`: 2 groups (100.0%) | 2 groups (100.0%) | 1x "
        "| 2 (1) | 0 |" in draws
    )
    assert (
        "| **all** | 10 | 5 / 8 | `task-0`: 3 groups (30.0%) | 2 groups (20.0%) | 1.5x "
        "| 5 (3) | 1 |" in draws
    )
    assert (
        "| boundary: parents of accepted tasks | 1 (1) | 8, 0.05, 0 | 4, 0.6, 0.5 | +0.55 |"
        in repaired
    )
    assert "| rare: parents of accepted tasks | 1 (0) | - | - | - |" in repaired
    assert "| raised a signal, no accepted child | 2 (1) | 4, 0, 0 | 4, 0.1, 0 | +0.1 |" in repaired
    assert "| no signal (seed) | 2 (1) | 4, 1, 1 | 4, 0.75, 0.75 | -0.25 |" in repaired
    assert (
        "| `task-10` | `task-0` | boundary | 1 | 2 | 2 (1) | v1: 0.05 (0/8 solved) "
        "| v5: 0.6 (2/4 solved) | +0.55 |" in repaired
    )
    assert (
        "| `task-11` | `task-1` | rare | 1 | 0 | 0 (0) | v1: 0 (0/4 solved) | - | - |" in repaired
    )
    assert "Measured: not run" in repaired


def test_a_run_without_steps_or_children_says_so(repair_run: Path, tmp_path: Path) -> None:
    (repair_run / STEPS_FILE).unlink()
    text = render_run_report(repair_run, tmp_path / "report").read_text()

    assert "No `learner/steps.jsonl`" in text
    assert "| `task-10` | `task-0` | boundary | 1 | 2 | - |" in text
    empty = render_run_report(tmp_path / "nothing", tmp_path / "empty").read_text()
    assert "Draws: none yet" in empty and "Repair: none yet" in empty


def test_measured_rows_aggregate_per_task_then_pair_the_versions() -> None:
    outcomes = {
        ("task-0", 1): [(0.0, 0.0), (0.0, 0.5)],
        ("task-0", 5): [(1.0, 1.0), (0.0, 0.5)],
        ("task-4", 1): [(1.0, 1.0), (1.0, 1.0)],
        ("task-4", 5): [(1.0, 1.0), (0.0, 0.0)],
        ("task-7", 1): [(0.0, None)],  # played at v1 only: counted, not paired
    }
    samples = [
        MeasuredSample(task, version, success, credit)
        for (task, version), played in outcomes.items()
        for success, credit in played
    ]
    rows = aggregate_measured(
        samples, {"boundary": ["task-0"], NO_SIGNAL: ["task-4", "task-7"]}, 1, 5
    )

    boundary, quiet = rows
    assert boundary["label"] == "boundary" and boundary["tasks"] == 1
    assert (boundary["samples_first"], boundary["samples_last"]) == (2, 2)
    assert (boundary["success_first"], boundary["success_last"]) == (0.0, 0.5)
    assert (boundary["partial_credit_first"], boundary["partial_credit_last"]) == (0.25, 0.75)
    assert boundary["success_change"]["mean"] == 0.5 and boundary["success_change"]["n"] == 1
    assert boundary["partial_credit_change"]["mean"] == 0.5
    assert (quiet["samples_first"], quiet["samples_last"]) == (3, 2)
    assert quiet["success_first"] == pytest.approx(2 / 3)
    assert quiet["partial_credit_first"] == 1.0  # the sample without partial credit is left out
    assert quiet["success_change"]["mean"] == -0.5 and quiet["success_change"]["n"] == 1


def fake_play(calls: list[tuple[int, list[str]]]) -> repair.Play:
    """Solves every task at v5, none at v1; partial credit 0.5 at v1."""

    def play(version: int, tasks: list[m.Task]) -> list[tuple[float, float | None]]:
        calls.append((version, [task.id for task in tasks]))
        return [(1.0, 1.0) if version == 5 else (0.0, 0.5) for _ in tasks]

    return play


def test_measured_repair_plays_parents_and_controls_at_v1_and_last_then_reuses(
    repair_run: Path, tmp_path: Path
) -> None:
    data = load_run(repair_run)
    assert repair_task_sets(data) == {
        "boundary": ["task-0"],
        "rare": ["task-1"],
        NO_SIGNAL: ["task-4", "task-5"],  # the drawn one first, then by id hash
    }
    calls: list[tuple[int, list[str]]] = []
    out = tmp_path / "report" / MEASURED_FILE
    lines: list[str] = []
    result = measure_repair(data, 2, fake_play(calls), out, log=lines.append)

    tasks = ["task-0", "task-0", "task-1", "task-1", "task-4", "task-4", "task-5", "task-5"]
    assert calls == [(1, tasks), (5, tasks)]
    assert "repair: policy v1: 4 tasks x 2 samples = 8 episodes" in lines
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert [row["success_change"]["mean"] for row in result["rows"]] == [1.0, 1.0, 1.0]
    assert len(result["samples"]) == 16

    again = measure_repair(load_run(repair_run), 2, fake_play(calls), out, log=lines.append)
    assert len(calls) == 2 and again == result  # reused, not played again
    text = render_run_report(repair_run, tmp_path / "report").read_text()
    assert "each task played 2 times by policy v1 and by v5" in text
    assert "| boundary | 1 | 2 / 2 | 0.000 -> 1.000 | +1.000 [+1.000, +1.000] p=1 |" in text
    assert "- boundary: success change +1.000 against +1.000 for the no-signal tasks" in text


def test_without_labels_the_d0_tasks_are_the_starting_pool_not_children(tmp_path: Path) -> None:
    """A no-label run starts from D0: tasks explored before the run (their parent an initial
    state, no verdict of this run) are controls and parents, never children."""
    run = tmp_path / "run"
    explored = [
        make_task(
            number,
            origin="explored",
            created_at=0.0,
            lineage=m.Lineage(parent_task_id=f"multi_turn_base_{number}#state"),
        )
        for number in range(3)
    ]
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks(explored)
        store.record_verdict(
            m.Verdict(
                candidate_id="cand-10",
                accepted=True,
                reasons=[],
                task=child(10, "task-0", "boundary"),
                created_at=T0,
            )
        )
    data = load_run(run)

    # the control: one of the two other D0 tasks, chosen by the hash of its id
    assert repair_task_sets(data) == {"boundary": ["task-0"], NO_SIGNAL: ["task-2"]}
    assert [row.child for row in child_rows(data)] == ["task-10"]


def test_unguided_tasks_of_initial_states_have_no_parent_to_repair(tmp_path: Path) -> None:
    run = tmp_path / "run"
    unguided = m.Lineage(parent_task_id="multi_turn_base_7#state")
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(0, created_at=0.0)])
        store.record_verdict(
            m.Verdict(
                candidate_id="cand-10",
                accepted=True,
                reasons=[],
                task=make_task(10, origin="explored", created_at=T0, lineage=unguided),
                created_at=T0,
            )
        )
    (run / "policies").mkdir()
    for version in (1, 2):
        (run / "policies" / f"v{version}.safetensors").write_bytes(b"weights")
    data = load_run(run)

    assert repair_task_sets(data) == {}
    with pytest.raises(ValueError, match="nothing to measure"):
        measure_repair(data, 2, fake_play([]), tmp_path / MEASURED_FILE)


def test_cli_measures_the_repair_when_asked(
    repair_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, list[str]]] = []
    monkeypatch.setattr(repair, "policy_play", lambda *args, **kwargs: fake_play(calls))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["report", str(repair_run), "--out", str(out), "--repair-samples", "1"]
    )

    assert result.exit_code == 0, result.output
    assert [version for version, _ in calls] == [1, 5]
    assert (out / MEASURED_FILE).exists()
    assert "repair: policy v5: 4 tasks x 1 samples = 4 episodes" in result.output
    assert "| rare | 1 | 1 / 1 | 0.000 -> 1.000 |" in (out / "report.md").read_text()
