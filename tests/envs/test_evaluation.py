"""Suite runner, Wilson interval and the `coevolve eval` command (ground-truth policy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from coevolve.cli.eval_cmd import PolicyChoiceError, eval_command, weights_for_version
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl import load_tasks
from coevolve.shared.evaluation import (
    EntryOutcome,
    ground_truth_player,
    run_suite,
    wilson_interval,
)
from coevolve.shared.messages import Task


def test_wilson_interval_properties() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(1 - high) and 0.40 < low < 0.41
    zero_low, zero_high = wilson_interval(0, 20)
    assert zero_low == 0.0 and 0.15 < zero_high < 0.17
    one_low, one_high = wilson_interval(20, 20)
    assert one_high == pytest.approx(1.0) and one_low == pytest.approx(1 - zero_high)
    # narrower with more data, always containing the observed proportion
    assert (lambda a, b: a[1] - a[0] > b[1] - b[0])(
        wilson_interval(7, 10), wilson_interval(70, 100)
    )
    for successes in range(11):
        low, high = wilson_interval(successes, 10)
        assert low <= successes / 10 <= high


def test_run_suite_scores_and_records_failures_and_errors() -> None:
    tasks = load_tasks("multi_turn_base")[:6]

    def player(task: Task) -> EntryOutcome:
        index = int(task.id.rsplit("_", 1)[1])
        if index == 4:
            raise RuntimeError("environment exploded")
        return EntryOutcome(1.0 if index % 2 == 0 else 0.0, f"entry {index}")

    report = run_suite(tasks, player, suite="s", split="eval", policy="p", progress=False)
    assert report.n == 6
    assert [e.score for e in report.entries] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert report.entries[4].error == "RuntimeError: environment exploded"
    assert report.accuracy == pytest.approx(2 / 6)
    assert report.ci95 == wilson_interval(2, 6)
    assert all(e.seconds >= 0 for e in report.entries)
    summary = report.summary()
    assert summary["errors"] == 1 and summary["n"] == 6
    assert "entry 1" in report.describe()


def test_batched_players_get_chunks_and_share_the_time() -> None:
    tasks = load_tasks("multi_turn_base")[:5]
    seen: list[list[str]] = []

    def batch_player(chunk: list[Task]) -> list[EntryOutcome]:
        seen.append([t.id for t in chunk])
        if len(chunk) == 1:
            raise RuntimeError("last batch failed")
        return [EntryOutcome(1.0) for _ in chunk]

    report = run_suite(
        tasks, batch_player, suite="s", split="all", policy="p", batch_size=2, progress=False
    )
    assert [len(c) for c in seen] == [2, 2, 1]
    assert [e.score for e in report.entries] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert report.entries[4].error == "RuntimeError: last batch failed"
    assert report.entries[0].seconds == report.entries[1].seconds


def test_ground_truth_player_scores_one() -> None:
    tasks = load_tasks("multi_turn_long_context")[:5]
    player = ground_truth_player(lambda: make_environment("bfcl"))
    report = run_suite(tasks, player, suite="s", split="all", policy="gt", progress=False)
    assert report.accuracy == 1.0


def _cli() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(eval_command)
    return app


def test_eval_command_ground_truth_json_on_the_last_line() -> None:
    args = ["--suite", "bfcl-multi-turn-base", "--classes", "all", "--policy", "ground-truth"]
    result = CliRunner().invoke(_cli(), [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["n"] == 200 and report["split"] == "all" and report["classes"] == "all"
    assert report["accuracy"] >= 0.99
    failing = [e for e in report["entries"] if e["score"] < 1.0]
    assert all("replay errors" in e["detail"] for e in failing)
    assert report["ci95_low"] <= report["accuracy"] <= report["ci95_high"]
    assert not math.isnan(report["seconds_per_entry"])


def test_eval_command_split_limit_and_text_output() -> None:
    result = CliRunner().invoke(
        _cli(),
        [
            "--suite",
            "bfcl-multi-turn-miss-param",
            "--split",
            "train",
            "--limit",
            "7",
            "--policy",
            "ground-truth",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "bfcl-multi-turn-miss-param [train] policy=ground-truth" in result.stdout
    assert "over 7 entries" in result.stdout


def test_eval_command_sample_spreads_over_entries_and_is_seeded() -> None:
    args = ["--suite", "bfcl-turns-base", "--split", "eval", "--policy", "ground-truth"]
    runs = [
        CliRunner().invoke(_cli(), [*args, "--sample", "12", "--seed", str(seed), "--json"])
        for seed in (0, 0, 1)
    ]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    ids = [[e["entry_id"] for e in report["entries"]] for report in reports]
    assert len(ids[0]) == 12 and ids[0] == ids[1] and ids[0] != ids[2]
    entries = {task_id.split("#")[0] for task_id in ids[0]}
    assert len(entries) > 12 // 4  # the first 12 tasks would be about three entries' turns
    assert reports[0]["sample"] == 12 and reports[0]["seed"] == 0
    both = CliRunner().invoke(_cli(), [*args, "--sample", "3", "--limit", "3"])
    assert both.exit_code != 0


def test_eval_command_rejects_bad_choices() -> None:
    runner = CliRunner()
    assert runner.invoke(_cli(), ["--suite", "nope", "--policy", "ground-truth"]).exit_code != 0
    assert runner.invoke(_cli(), ["--split", "test", "--policy", "ground-truth"]).exit_code != 0
    bad_policy = runner.invoke(_cli(), ["--policy", "/no/such/weights.bin", "--limit", "1"])
    assert bad_policy.exit_code != 0


def test_missing_policy_version_names_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(PolicyChoiceError, match=r"v7\.safetensors"):
        weights_for_version(tmp_path, 7)
