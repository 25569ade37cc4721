"""``coevolve experiences list|show``, and the report's experiences and step-credit
sections, against a real DuckDB file and a real pool-store on a real NATS server."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from coevolve.cli.experiences_cmd import experiences_app
from coevolve.report.run_data import load_run
from coevolve.report.run_report import run_markdown, summarize_run
from coevolve.services.learner.handler import STEPS_FILE, record_step
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import keep_experience, rollout_jobs
from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import Experience, Task
from tests.dataloop.dataloop_harness import filesystem_seed_tasks
from tests.support.messages import rewarded_group
from tests.support.pool_store import pool_store_in_portal

ADVICE = "Call cd into the target folder before touch, not after."


def cli() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.add_typer(experiences_app, name="experiences")
    return app


def experience_of(task: Task) -> Experience:
    return Experience(
        id="exp-1",
        text=ADVICE,
        task_id=task.id,
        environment=task.environment,
        request="\n".join(task.user_turns),
        group_id="group-1",
        trajectory_ids=["traj-best", "traj-worst"],
        rewards=[1.0, 0.2],
        policy_version=4,
        functions=["cd", "touch"],
    )


@pytest.fixture
def pool_file(settings: Settings) -> Path:
    task = filesystem_seed_tasks(1)[0]
    path = settings.run_dir / "pool.duckdb"
    with PoolStore(path) as store:
        store.add_tasks([task])
        keep_experience(store, experience_of(task))
        config = PoolStoreConfig(sampling=SamplingConfig(sampler="uniform"))
        (job,) = rollout_jobs(store, 1, config, queue_seq=1, first_round=0)
        assert [e.id for e in job.experiences] == ["exp-1"]
    return path


def invoke(settings: Settings, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        cli(), [*args, "--run-dir", str(settings.run_dir)], env={"NATS_URL": settings.bus.url}
    )
    return result.exit_code, result.stdout, result.stderr


def test_experiences_from_the_file_and_in_the_report(settings: Settings, pool_file: Path) -> None:
    code, out, err = invoke(settings, "experiences", "list", "--json")
    assert code == 0, err
    assert "no pool-store answering" in err
    listing = json.loads(out)
    assert listing["total"] == 1 and listing["uses"] == {"exp-1": 1}

    code, out, _ = invoke(settings, "experiences", "show", "exp")
    assert code == 0
    assert f"advice: {ADVICE}" in out and "carried by 1 rollout jobs" in out
    assert "traj-best (reward 1.00), traj-worst (reward 0.20)" in out

    code, _, err = invoke(settings, "experiences", "show", "nope")
    assert code == 1 and "no experience with id 'nope'" in err

    labelled = rewarded_group("g1", "task-a", "seed", 1, 1.0, 0.0)
    labelled.label_s = 4.0
    labelled.trajectories[0].step_labels = [1, 1]
    labelled.trajectories[1].step_labels = [-1]
    record_step(
        settings.run_dir / STEPS_FILE,
        [labelled],
        StepMetrics(
            **{
                **{f.name: 0 for f in dataclasses.fields(StepMetrics)},
                "step": 1,
                "version": 2,
                "trained": True,
            }
        ),
        version_before=1,
        max_staleness=4,
    )
    data = load_run(settings.run_dir)
    report = run_markdown(data, summarize_run(data))
    assert "## Experiences" in report and f"> {ADVICE}" in report
    assert "drew 1 experiences from rollout groups; rollout jobs carried them 1 times" in report
    assert "## Step credit" in report
    assert "labelled 2 trajectories of 1 trained groups: 2 steps GOOD, 1 BAD (0.67 GOOD)" in report
    assert "It took 4 s, 4.0 s a learner step" in report


def test_experiences_through_a_running_pool_store(settings: Settings, pool_file: Path) -> None:
    settings.services["pool_store"] = {"feed_jobs": False}
    with pool_store_in_portal(settings):
        code, out, err = invoke(settings, "experiences", "list")
    assert code == 0, err
    assert "no pool-store answering" not in err
    assert "1 experiences kept" in out and ADVICE[:40] in out
