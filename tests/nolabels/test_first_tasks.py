"""`up` with no D0 file builds only D0's first tasks before training starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from coevolve.cli import app, discover_cmd
from coevolve.cli.status import d0_build_line, d0_build_progress
from coevolve.shared.config import ConfigError, Settings, load_settings
from coevolve.shared.runtime.nats_server import free_port
from coevolve.shared.task_sets import D0File, ExplorationRecord, load_d0, partial_path


@pytest.mark.parametrize(
    ("first", "tasks", "built", "completed_to"), [(4, 24, 4, 24), (30, 24, 24, 0)]
)
def test_up_builds_the_first_tasks_of_a_missing_d0(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed_d0: Path,
    first: int,
    tasks: int,
    built: int,
    completed_to: int,
) -> None:
    """Only the first tasks, marked as such so that discovery beside training completes
    them to ``d0.tasks``; a first set as large as D0 is a whole D0."""
    settings = load_settings(run_dir=str(tmp_path / "run"))
    settings.run_dir.mkdir()  # up prepares the run directory before D0
    settings.labels = "none"
    settings.d0.first_tasks, settings.d0.tasks = first, tasks
    asked: list[tuple[int, int]] = []

    def build(given: Settings, out: Path, echo: bool = True, first_tasks_of: int = 0) -> D0File:
        asked.append((given.d0.tasks, first_tasks_of))
        shutil.copy(committed_d0, out)
        return discover_cmd.load_d0(out)

    monkeypatch.setattr(discover_cmd, "build_d0", build)
    assert discover_cmd.ensure_d0(settings) == settings.d0.path(settings.run_dir)
    assert asked == [(built, completed_to)] and settings.d0.tasks == tasks
    discover_cmd.ensure_d0(settings)  # the file is there now: nothing is built
    assert asked == [(built, completed_to)]


def test_first_tasks_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="first_tasks"):
        load_settings(run_dir=str(tmp_path), d0={"first_tasks": 0})


def test_status_shows_the_d0_build_before_the_services_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, committed_d0: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    task = load_d0(committed_d0).tasks[0]
    records = [
        ExplorationRecord(index=0, start_id="s0", outcome="explored", accepted=[task], seconds=90),
        ExplorationRecord(index=1, start_id="s1", outcome="empty", seconds=30),
    ]
    partial_path(run_dir / "d0.json").write_bytes(
        b"".join(msgspec.json.encode(record) + b"\n" for record in records)
    )
    monkeypatch.setenv("NATS_URL", f"nats://127.0.0.1:{free_port()}")  # nothing listens
    result = CliRunner().invoke(app, ["status", "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    building = json.loads(result.output.strip().splitlines()[-1])["d0_build"]
    assert building["explorations"] == 2 and building["tasks_ready"] == 1
    assert building["minutes"] == 2.0 and building["first_tasks"] == 4
    text = CliRunner().invoke(app, ["status", "--run-dir", str(run_dir)]).output
    assert "2 explorations in 2 min, 1 tasks ready; `up` starts the services at 4" in text
    (run_dir / "d0.json.partial.jsonl").unlink()  # no build under way: up is not running
    assert CliRunner().invoke(app, ["status", "--run-dir", str(run_dir)]).exit_code == 1


def test_status_counts_the_held_out_tasks_of_a_users_d0_apart(
    tmp_path: Path, committed_d0: Path
) -> None:
    settings = load_settings(run_dir=str(tmp_path / "run"), d0={"environment": "shop"})
    settings.run_dir.mkdir()
    tasks = load_d0(committed_d0).tasks[:3]
    record = ExplorationRecord(index=0, start_id="s0", outcome="explored", accepted=tasks)
    partial_path(settings.d0.path(settings.run_dir)).write_bytes(msgspec.json.encode(record))
    building = d0_build_progress(settings)
    # the 1st of every 5 accepted is held out for the evaluator: 2 ready to train on
    assert building is not None and (building["tasks_ready"], building["held_out"]) == (2, 1)
    assert "2 tasks ready and 1 held out" in d0_build_line(building)
