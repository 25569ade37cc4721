"""A user's own environment, run with no labels: named in the configuration, its D0 (from
`coevolve discover`, or here from calls replayed in it), then real services that
warm-start on D0 and publish a policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

import coevolve.shared.envs as envs
from coevolve.shared.config import Settings, load_settings
from coevolve.shared.envs import make_environment, start_tasks
from coevolve.shared.messages import ToolCall
from coevolve.shared.task_sets import D0Build, D0File, load_d0, write_d0
from coevolve.shared.toolcalls import format_tool_calls
from tests.integration.conftest import loop_settings  # noqa: F401  (fixture)
from tests.nolabels.notes_env import INITIAL_STATES, SECTION
from tests.nolabels.services_harness import until_first_group

ROOT = Path(__file__).resolve().parents[2]

# (request, calls) pairs a user of the notebook could ask, each in the first initial state
REQUESTS = [
    ("Show me the titles of all my notes.", [("list_notes", {})]),
    ("What did I write in the note called groceries?", [("read_note", {"title": "groceries"})]),
    ("Archive the plumber note, it is done.", [("archive_note", {"title": "plumber"})]),
    (
        "Add a note titled dentist that says 'Tuesday at 4 pm'.",
        [("add_note", {"title": "dentist", "text": "Tuesday at 4 pm"})],
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def notebook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The notebook registered through a configuration file, as a user names it."""
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))
    monkeypatch.setattr(envs, "_STARTS", dict(envs._STARTS))
    config = tmp_path / "coevolve.yaml"
    config.write_text(
        yaml.safe_dump(
            {"labels": "none", "environments": SECTION, "d0": {"environment": "notebook"}}
        )
    )
    return config


def replayed_d0(path: Path) -> D0File:
    """D0 of the notebook from requests whose calls replay without error in it."""
    start = start_tasks("notebook")[0]
    tasks = []
    for index, (request, calls) in enumerate(REQUESTS):
        task = msgspec.structs.replace(
            start,
            id=f"notebook-d0-{index}",
            user_turns=[request],
            ground_truth=[[ToolCall(name=name, arguments=args) for name, args in calls]],
            origin="explored",
        )
        environment = make_environment("notebook")
        environment.reset(task)
        assert environment.replay(task.ground_truth).ok, request
        tasks.append(task)
    d0 = D0File(
        environment="notebook",
        classes=None,
        role_model="replayed by the test",
        code_version=None,
        created_at="2026-11-29T00:00:00+00:00",
        build=D0Build(minutes=0.0, explorations=0),
        sha256="",
        tasks=tasks,
    )
    write_d0(path, d0)
    return d0


def test_a_configured_class_is_an_environment_with_start_states(notebook: Path) -> None:
    settings = load_settings(notebook)
    assert settings.labels == "none" and settings.d0.environment == "notebook"
    starts = start_tasks("notebook")
    assert [s.initial_state for s in starts] == INITIAL_STATES
    assert all(s.user_turns == [] and s.ground_truth == [] for s in starts)
    environment = make_environment("notebook")
    assert environment.reset(starts[0]) == []
    names = {tool["function"]["name"] for tool in environment.tools()}
    assert names == {"list_notes", "read_note", "add_note", "archive_note"}
    d0 = replayed_d0(notebook.parent / "d0.json")
    task = d0.tasks[1]
    environment.reset(task)
    call = format_tool_calls(task.ground_truth[0])
    environment.step(call)
    environment.step("It says milk, eggs, bread.")
    assert environment.score() == 1.0


@pytest.mark.anyio
async def test_no_labels_run_on_a_users_environment_publishes_a_policy(
    notebook: Path,
    loop_settings: Settings,  # noqa: F811
) -> None:
    configured = load_settings(notebook)
    replayed_d0(loop_settings.run_dir / "d0.json")
    loop_settings.labels = configured.labels
    loop_settings.d0 = configured.d0
    first = await until_first_group(loop_settings, demo_tasks=2)
    assert first.announced_version == 1
    assert {k: n for k, n in first.pool.tasks_by_origin.items() if n} == {"explored": len(REQUESTS)}
    assert first.pool.results >= 1


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_discover_builds_d0_of_a_users_environment_with_the_local_model(
    notebook: Path, tmp_path: Path
) -> None:
    out = tmp_path / "d0.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "coevolve", "discover", "--config", str(notebook)]
    command += ["--run-dir", str(tmp_path / "run"), "--out", str(out), "--tasks", "1"]
    result = subprocess.run(
        [*command, "--max-explorations", "12", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    d0 = load_d0(out)
    assert summary["tasks"] == len(d0.tasks) == 1 and d0.environment == "notebook"
    names = {"list_notes", "read_note", "add_note", "archive_note"}
    task = d0.tasks[0]
    assert task.user_turns and {call.name for call in task.ground_truth[0]} <= names
    assert task.lineage.exploration_mode == "unguided"
    assert "[d0] exploration 1/12" in result.stderr
