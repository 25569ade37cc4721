"""The learner sweep's bookkeeping: its points are valid settings, finished points are
skipped, and the report is built from the result files alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from coevolve.cli import app
from coevolve.experiment import sweep
from coevolve.experiment.ablation import per_task
from coevolve.experiment.machine import machine_facts
from coevolve.experiment.sweep import (
    POINTS,
    POINTS_BY_NAME,
    WARM_FILES,
    SweepMismatchError,
    SweepPoint,
    SweepSpec,
    parse_points,
    point_result,
    render_sweep_report,
    run_point,
    run_sweep,
)
from coevolve.harness import UpRun
from coevolve.report.compare import compare_reports
from coevolve.services.learner.config import LearnerServiceConfig
from coevolve.services.rollout.config import RolloutConfig
from tests.support.harness import IDLE_UP, standin_up


def test_every_point_is_a_valid_section_of_its_service() -> None:
    structs = {"learner": LearnerServiceConfig, "rollout": RolloutConfig}
    for point in POINTS:
        section = point.settings()["services"][point.service]
        config = msgspec.convert(section, structs[point.service])
        for dotted, value in point.overrides.items():
            node: Any = config
            for key in dotted.split("."):
                node = getattr(node, key)
            assert node == value, (point.name, dotted)


def test_a_point_nests_its_dotted_keys() -> None:
    point = SweepPoint("x", {"grpo.lr": 1e-3, "grpo.kl_beta": 0.1, "max_wait_s": 5.0})
    assert point.settings() == {
        "services": {"learner": {"grpo": {"lr": 1e-3, "kl_beta": 0.1}, "max_wait_s": 5.0}}
    }
    sampling = SweepPoint("t", {"temperature": 0.7}, service="rollout")
    assert sampling.settings() == {"services": {"rollout": {"temperature": 0.7}}}


def test_unknown_points_are_refused() -> None:
    assert parse_points("default, lr-1e-4") == ("default", "lr-1e-4")
    with pytest.raises(ValueError, match="lr-7"):
        parse_points("default,lr-7")


def report(scores: dict[str, tuple[int, float, float]], policy: str) -> dict[str, Any]:
    """An eval report: per task (success, partial credit, log-likelihood)."""
    return {
        "policy": policy,
        "n": len(scores),
        "accuracy": sum(s for s, _, _ in scores.values()) / len(scores),
        "partial_credit_mean": sum(p for _, p, _ in scores.values()) / len(scores),
        "gt_logprob_per_token": sum(g for _, _, g in scores.values()) / len(scores),
        "entries": [
            {"entry_id": task, "score": s, "partial_credit": p, "gt_logprob": g}
            for task, (s, p, g) in scores.items()
        ],
    }


def write_point(out: Path, name: str, last: dict[str, Any], v1: dict[str, Any]) -> None:
    point = next(p for p in POINTS if p.name == name)
    result = {
        "point": name,
        "overrides": dict(point.overrides),
        "minutes": 20.0,
        "last_version": 6,
        "machine": machine_facts(),
        "last_minus_v1": compare_reports(last, v1),
        "tune_last": per_task(last),
        "summary": {"learner_steps": 5, "groups_recorded": 30},
    }
    path = point_result(out, name)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    tasks = [f"t{i}" for i in range(12)]
    v1 = report({t: (0, 0.2, -1.0) for t in tasks}, "v1")
    better = report({t: (1 if i < 8 else 0, 0.6, -0.5) for i, t in enumerate(tasks)}, "v6")
    same = report({t: (0, 0.2, -1.0) for t in tasks}, "v6")
    write_point(tmp_path, "lr-1e-4", same, v1)
    write_point(tmp_path, "default", better, v1)
    (tmp_path / "sweep.json").write_text(
        json.dumps({"minutes": 20.0, "tune_tasks": 12, "tune_seed": 0})
    )
    return tmp_path


def test_the_report_orders_points_and_shows_paired_differences(sweep_dir: Path) -> None:
    text = render_sweep_report(sweep_dir)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    default_row = next(r for r in rows if r.startswith("| default "))
    slow_row = next(r for r in rows if r.startswith("| lr-1e-4 "))
    assert rows.index(default_row) < rows.index(slow_row)  # the order of POINTS
    # 8 of 12 won, none lost: +0.667, sign test p = 2 * 0.5**8
    assert "+0.667" in default_row and "p=0.00781" in default_row
    assert "grpo.lr=0.0001" in slow_row and "+0.000" in slow_row
    # against the default point's last policy: 0.2 - 0.6 partial credit on every turn
    assert slow_row.rstrip(" |").split(" | ")[-2].startswith("-0.400 [-0.400, -0.400]")
    assert default_row.endswith("| - | - |")
    assert (sweep_dir / "report.md").read_text() == text


def test_a_finished_sweep_starts_nothing(sweep_dir: Path) -> None:
    spec = SweepSpec(points=("default", "lr-1e-4"), tune_tasks=12)
    assert run_sweep(spec, sweep_dir, sweep_dir / "no-such-run") == []


def test_a_sweep_directory_keeps_its_tuning_set(sweep_dir: Path) -> None:
    spec = SweepSpec(points=("default",), tune_tasks=80)
    with pytest.raises(SweepMismatchError, match="tune_tasks"):
        run_sweep(spec, sweep_dir, sweep_dir / "no-such-run")


def test_the_cli_prints_the_report_and_refuses_unknown_points(sweep_dir: Path) -> None:
    runner = CliRunner()
    shown = runner.invoke(app, ["experiment", "sweep", "--report-only", "--out", str(sweep_dir)])
    assert shown.exit_code == 0, shown.output
    assert "| default |" in shown.output
    refused = runner.invoke(
        app, ["experiment", "sweep", "--points", "lr-9", "--out", str(sweep_dir)]
    )
    assert refused.exit_code == 2
    assert "lr-9" in refused.output


def test_the_help_names_every_point() -> None:
    shown = CliRunner().invoke(app, ["experiment", "sweep", "--help"], terminal_width=400)
    text = " ".join(shown.output.replace("│", " ").split())
    for point in POINTS:
        assert re.search(rf"(?<![\w.-]){re.escape(point.name)}(?![\w-])", text), point.name


def test_a_point_runs_its_minutes_from_the_warm_start_and_scores_its_last_policy(
    tmp_path: Path, pool_only_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sweep"
    warm = out / "warm" / "run"
    warm.parent.mkdir(parents=True)
    pool_only_run.rename(warm)
    for name in WARM_FILES:
        (warm / name).parent.mkdir(parents=True, exist_ok=True)
        (warm / name).write_bytes(name.encode())
    tasks = {"t1": (0, 0.2, -1.0), "t2": (1, 1.0, -0.5)}
    (out / "warm" / "tune-v1.json").write_text(json.dumps(report(tasks, "v1")))
    started: list[UpRun] = []
    scored: list[Path] = []

    def start(run: Path, log_path: Path, *args: object) -> UpRun:
        started.append(standin_up(run, log_path))
        return started[-1]

    def score(weights: Path, *args: object) -> dict[str, Any]:
        scored.append(weights)
        return report(tasks, "last")

    monkeypatch.setattr(sweep, "start_up", start)
    monkeypatch.setattr(sweep, "score_on_tuning_set", score)
    spec = SweepSpec(points=("lr-1e-4",), minutes=0.01, tune_tasks=2)
    lines: list[str] = []
    result = run_point(spec, out, POINTS_BY_NAME["lr-1e-4"], tmp_path, lines.append)

    run = point_result(out, "lr-1e-4").parent / "run"
    assert json.loads(point_result(out, "lr-1e-4").read_text()) == result
    assert started[0].elapsed_s() >= 0.6 and not started[0].running  # its minutes, stopped
    assert (run / "checkpoints" / "learner.pt").read_bytes() == b"checkpoints/learner.pt"
    assert scored == [run / "policies" / "v1.safetensors"] and result["last_version"] == 1
    assert result["summary"]["pool_by_origin"] == {"seed": 4}
    assert result["started_at"] == started[0].started_at
    assert lines[0] == f"[sweep] lr-1e-4: 0.01 min in {run}"

    def exits(run: Path, log_path: Path, *args: object) -> UpRun:
        return standin_up(run, log_path, IDLE_UP.replace("time.sleep(120)", "sys.exit(3)"))

    monkeypatch.setattr(sweep, "start_up", exits)
    with pytest.raises(RuntimeError, match="exited with 3"):
        run_point(spec, out, POINTS_BY_NAME["default"], tmp_path, lines.append)
    assert not point_result(out, "default").exists()
