"""`up` with no D0 file builds only D0's first tasks before training starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from coevolve.cli import discover_cmd
from coevolve.shared.config import ConfigError, Settings, load_settings
from coevolve.shared.task_sets import D0File


@pytest.mark.parametrize(("first", "tasks", "built"), [(4, 24, 4), (30, 24, 24)])
def test_up_builds_the_first_tasks_of_a_missing_d0(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    committed_d0: Path,
    first: int,
    tasks: int,
    built: int,
) -> None:
    settings = load_settings(run_dir=str(tmp_path / "run"))
    settings.labels = "none"
    settings.d0.first_tasks, settings.d0.tasks = first, tasks
    asked: list[int] = []

    def build(given: Settings, out: Path, echo: bool = True) -> D0File:
        asked.append(given.d0.tasks)
        shutil.copy(committed_d0, out)
        return discover_cmd.load_d0(out)

    monkeypatch.setattr(discover_cmd, "build_d0", build)
    assert discover_cmd.ensure_d0(settings) == settings.d0.path(settings.run_dir)
    assert asked == [built] and settings.d0.tasks == tasks
    discover_cmd.ensure_d0(settings)  # the file is there now: nothing is built
    assert asked == [built]


def test_first_tasks_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="first_tasks"):
        load_settings(run_dir=str(tmp_path), d0={"first_tasks": 0})
