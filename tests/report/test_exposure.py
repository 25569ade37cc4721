"""Exposure in ``coevolve report`` and ``coevolve status``: a small run directory made by
hand (a pool written by PoolStore, ``learner/steps.jsonl`` as the learner writes it), its
figures computed by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coevolve.report.exposure import (
    EXPOSURE_FILE,
    exposure,
    status_exposure,
    status_line,
    status_record,
)
from coevolve.report.run_data import load_run
from coevolve.report.run_report import REPORT_FILE, render_run_report
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Lineage, RolloutResults, ScoreSample, ToolCall, Verdict
from coevolve.shared.runtime.nats_server import NatsServer
from tests.report.conftest import T0, make_task


def child(
    number: int, parent: str, version: int | None, calls: list[ToolCall] | None = None
) -> Verdict:
    task = make_task(
        number,
        origin="synthesized",
        lineage=Lineage(
            signal_id=f"sig-{number}",
            signal_kind="boundary",
            parent_task_id=parent,
            signal_version=version,
        ),
    )
    if calls is not None:
        task = msgspec.structs.replace(task, ground_truth=[calls])
    return Verdict(
        candidate_id=f"cand-{number}", accepted=True, reasons=[], task=task, created_at=T0 + number
    )


def results(group: str, task_id: str, versions: list[int]) -> RolloutResults:
    samples = [
        ScoreSample(task_id=task_id, policy_version=v, score=float(i % 2), length=5)
        for i, v in enumerate(versions)
    ]
    return RolloutResults(group_id=group, samples=samples)


def group(origin: str, uniform: bool = False, agent: str = "target") -> dict[str, Any]:
    entry: dict[str, Any] = {
        "group_id": f"g-{origin}",
        "task_id": "task-10" if origin == "synthesized" else "task-0",
        "origin": origin,
        "policy_version": 1,
        "reward_mean": 0.5,
        "uniform": uniform,
    }
    if agent != "target":
        entry |= {"agent": agent, "rewards": [0.0, 1.0]}
    return entry


def step(number: int, published: bool, groups: list[dict[str, Any]]) -> str:
    record = {
        "step": number,
        "version": number + 1,
        "published": published,
        "time": T0 + 60 * number,
        "groups": groups,
        "stale": [group("synthesized")],  # dropped stale: never trained
    }
    return json.dumps(record) + "\n"


@pytest.fixture
def exposure_run(tmp_path: Path) -> Path:
    """Seeds task-0 and task-1; accepted children of signals: task-10 (parent task-0, its
    signal at v2, first drawn at v5), task-11 (task-0, v3, never drawn), task-12 (task-1,
    v1, two calls, a group whose trajectories span v3 to v5) and task-13 (task-1, no
    signal version, drawn)."""
    run = tmp_path / "run"
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(0, created_at=0.0), make_task(1, created_at=0.0)])
        two_calls = [
            ToolCall(name="ls", arguments={"a": True}),
            ToolCall(name="cd", arguments={"folder": "archive"}),
        ]
        for verdict in (
            child(10, "task-0", 2),
            child(11, "task-0", 3),
            child(12, "task-1", 1, two_calls),
            child(13, "task-1", None),
        ):
            store.record_verdict(verdict)
        for name, task_id, versions in (
            ("r1", "task-10", [5, 5]),
            ("r2", "task-10", [7, 7]),
            ("r3", "task-12", [5, 3, 4]),
            ("r4", "task-13", [6, 6]),
            ("r5", "task-0", [1, 1]),
        ):
            store.record_results(results(name, task_id, versions))
    steps = run / "learner" / "steps.jsonl"
    steps.parent.mkdir(parents=True)
    steps.write_text(
        # first half: 1 of the 4 trained target groups with a gradient is synthesized
        step(
            1,
            True,
            [
                group("seed"),
                group("synthesized"),
                group("seed", uniform=True),
                group("synthesized", agent="failure"),
            ],
        )
        + step(2, True, [group("seed"), group("explored")])
        # second half: step 3 updated nothing; step 4: 1 of 2
        + step(3, False, [group("synthesized"), group("synthesized")])
        + step(4, True, [group("synthesized"), group("seed"), group("synthesized", uniform=True)])
        + "not json\n"
    )
    return run


def test_exposure_figures_equal_the_hand_computed_ones(exposure_run: Path) -> None:
    figures = exposure(load_run(exposure_run))
    assert figures.learner_steps == 3  # step 3 updated nothing
    assert figures.first_half == pytest.approx(0.25)
    assert figures.second_half == pytest.approx(0.5)
    # task-10: 5 - 2; task-12: its oldest trajectory, 3 - 1; task-13 names no version
    assert figures.versions_to_first_draw == {
        "task-10": 3,
        "task-11": None,
        "task-12": 2,
        "task-13": None,
    }
    # task-11, never drawn: the run reached v7, 4 versions past its signal's v3 and so
    # past the contract's 2; it waited at least 5, and counts so in the median of 3, 2, 5
    assert figures.overdue == (5,)
    assert figures.median_versions_to_first_draw == pytest.approx(3.0)
    assert (figures.with_signal_version, figures.never_drawn) == (3, 1)
    # with a contract of 4 versions it might still have been drawn in time: left out
    lenient = exposure(load_run(exposure_run), contract=4)
    assert lenient.overdue == ()
    assert lenient.median_versions_to_first_draw == pytest.approx(2.5)


def test_a_labelled_control_runs_added_turns_count_as_its_exposure(tmp_path: Path) -> None:
    """A no-label run of the labelled_control arm: D0's task-0 from the start, and the
    labelled turn task-20 the controller added (origin seed, ``lineage.labelled_control``):
    groups on it count as the synthesized ones do in the other arms."""
    run = tmp_path / "run"
    control = make_task(20, origin="seed", lineage=Lineage(labelled_control=True))
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(0, origin="explored", created_at=0.0), control])
    on_turn = {**group("seed"), "task_id": "task-20"}
    on_d0 = {**group("explored"), "task_id": "task-0"}
    (run / "learner").mkdir()
    (run / "learner" / "steps.jsonl").write_text(
        step(1, True, [on_d0, on_d0]) + step(2, True, [on_turn, on_d0])
    )

    figures = exposure(load_run(run))

    assert (figures.first_half, figures.second_half) == (0.0, 0.5)
    assert figures.control_turns == 1
    assert "on synthesized tasks or the 1 labelled turns added: 0% in the first half" in (
        render_run_report(run, tmp_path / "report").read_text()
    )
    written = json.loads((tmp_path / "report" / EXPOSURE_FILE).read_text())
    assert written["setting"] == "no_labels"  # its seed task is the control's turn
    assert written["exposure_second_half"] == 0.5
    assert status_line(figures, None).startswith(
        "exposure: synthesized and labelled-control share of trained groups with a gradient 0%"
    )


def test_the_report_writes_exposure_json_and_an_exposure_section(
    exposure_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    report = render_run_report(exposure_run, out).read_text()
    assert report.index("## Exposure") < report.index("## Verdicts")
    assert "25% in the first half of the 3 learner steps, 50% in the second" in report
    assert "2 were drawn, 1 never; the median child waited 3 versions from its signal" in report
    assert "(1 never drawn past the contract count as waiting longer)" in report

    written = json.loads((out / EXPOSURE_FILE).read_text())
    assert list(written) == [
        "setting",
        "learner_steps",
        "accepted",
        "multi_call_share",
        "distinct_parents",
        "exposure_first_half",
        "exposure_second_half",
        "median_versions_to_first_draw",
        "never_drawn",
        "tasks",
    ]
    tasks = written.pop("tasks")
    assert written == {
        "setting": "labelled",  # no configuration file; the pool holds seed tasks
        "learner_steps": 3,
        "accepted": 4,
        "multi_call_share": 0.25,
        "distinct_parents": 2,
        "exposure_first_half": 0.25,
        "exposure_second_half": 0.5,
        "median_versions_to_first_draw": 3.0,
        "never_drawn": 1,
    }
    assert [t["task_id"] for t in tasks] == ["task-10", "task-11", "task-12", "task-13"]
    assert tasks[0] == {
        "task_id": "task-10",
        "parent_request": "Move report_0.txt into the archive folder.",
        "parent_calls": ['mv(source="report_0.txt")'],
        "request": "Move report_10.txt into the archive folder.",
        "calls": ['mv(source="report_10.txt")'],
        "versions_to_first_draw": 3,
        "label": None,
        "reason": None,
    }
    assert tasks[2]["calls"] == ["ls(a=true)", 'cd(folder="archive")']
    assert tasks[2]["parent_request"] == "Move report_1.txt into the archive folder."


def test_the_setting_comes_from_the_runs_configuration_when_it_has_one(
    exposure_run: Path, tmp_path: Path
) -> None:
    (exposure_run / "coevolve.yaml").write_text("labels: none\n")
    render_run_report(exposure_run, tmp_path / "report")
    assert json.loads((tmp_path / "report" / EXPOSURE_FILE).read_text())["setting"] == "no_labels"
    assert (tmp_path / "report" / REPORT_FILE).exists()


def test_status_reads_the_pool_only_when_no_pool_store_holds_it(exposure_run: Path) -> None:
    figures, unread = status_exposure(exposure_run)
    assert unread is None
    assert status_record(figures, unread) == {
        "learner_steps": 3,
        "exposure_first_half": 0.25,
        "exposure_second_half": 0.5,
        "median_versions_to_first_draw": 3.0,
        "never_drawn": 1,
        "pool_unread": None,
    }
    assert "median versions to first draw 3 (1 of 3 never drawn)" in status_line(figures, unread)

    with PoolStore(exposure_run / "pool.duckdb"):  # a pool-store holds the file
        figures, unread = status_exposure(exposure_run)
    assert unread is not None
    record = status_record(figures, unread)
    assert (record["exposure_first_half"], record["exposure_second_half"]) == (0.25, 0.5)
    assert record["median_versions_to_first_draw"] is None
    assert "versions to first draw not read" in status_line(figures, unread)


def test_status_json_carries_the_exposure(
    exposure_run: Path, nats_server: NatsServer, tmp_path: Path
) -> None:
    import typer
    from typer.testing import CliRunner

    from coevolve.cli import status

    app = typer.Typer(add_completion=False)
    app.command("status")(status.status)
    app.command("unused")(lambda: None)  # two commands: `status` stays a subcommand
    args = ["status", "--run-dir", str(exposure_run), "--json"]
    result = CliRunner().invoke(app, args, env={"NATS_URL": nats_server.url})
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["exposure"]["exposure_first_half"] == 0.25
    assert report["exposure"]["median_versions_to_first_draw"] == 3.0

    result = CliRunner().invoke(app, args[:-1], env={"NATS_URL": nats_server.url})
    assert result.exit_code == 0, result.stderr
    assert "exposure: synthesized share of trained groups with a gradient 25%" in result.stdout
