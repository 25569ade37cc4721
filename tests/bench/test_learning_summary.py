"""The learning benchmark's paired summary: GRPO - warm start over seeds and tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coevolve.bench.learning import paired_summary
from coevolve.report.stats import paired_bootstrap_interval


def seed_result(seed: int, warm: list[float], final: list[float]) -> dict[str, Any]:
    def episodes(rewards: list[float]) -> list[dict[str, Any]]:
        return [{"task_id": f"t{i}", "reward": r} for i, r in enumerate(rewards)]

    return {
        "seed": seed,
        "heldout_success_warm_start": sum(warm) / len(warm),
        "heldout_success_grpo_final": sum(final) / len(final),
        "final_label": "grpo_4",
        "heldout_episodes": {"warm_start": episodes(warm), "grpo_4": episodes(final)},
        "warm_start": {"epochs": 3},
        "wall_s": 10.0,
    }


def test_paired_summary_interval_and_task_counts() -> None:
    results = [
        seed_result(0, [1, 0, 0, 0], [1, 1, 0, 0]),  # +0.25: t1 gained
        seed_result(1, [1, 1, 0, 0], [1, 1, 1, 1]),  # +0.50: t2, t3 gained
        seed_result(2, [1, 1, 1, 0], [0, 1, 1, 0]),  # -0.25: t0 lost
    ]
    summary = paired_summary(results)
    assert summary["difference_mean"] == pytest.approx(0.1667, abs=1e-4)
    # over the seeds' means: mean 1/6, sample sd 0.3819, t(0.975, 2) = 4.3027: +-0.9487
    t_low, t_high = summary["seed_t_ci95"]
    assert t_low == pytest.approx(0.1667 - 0.9487, abs=1e-3)
    assert t_high == pytest.approx(0.1667 + 0.9487, abs=1e-3)
    # the headline: seeds, then tasks within them, resampled (per-task differences)
    expected = paired_bootstrap_interval({0: [0, 1, 0, 0], 1: [0, 0, 1, 1], 2: [-1, 0, 0, 0]})
    low, high = summary["difference_ci95"]
    assert summary["grpo_minus_warm_start"] == summary["difference_mean"]
    assert summary["grpo_minus_warm_start_ci"] == [low, high]
    assert (low, high) == (round(expected.low, 4), round(expected.high, 4))
    assert t_low < low < 0.1667 < high < t_high
    assert (summary["tasks_gained"], summary["tasks_lost"]) == (3, 1)
    assert summary["sign_test_p"] == pytest.approx(0.625, abs=1e-3)
    assert summary["warm_start_epochs"] == [3, 3, 3]


def test_one_seed_has_a_task_interval_only() -> None:
    summary = paired_summary([seed_result(0, [0, 0, 0, 0], [1, 0, 1, 1])])
    assert summary["seed_t_ci95"] is None
    assert summary["difference_mean"] == pytest.approx(0.75)
    low, high = summary["difference_ci95"]
    assert 0.0 <= low < 0.75 < high <= 1.0


def test_bench_resume_reads_finished_seeds_back(tmp_path: Path) -> None:
    """``coevolve bench learning --resume DIR`` runs no seed that DIR already holds."""
    from typer.testing import CliRunner

    from coevolve.cli import app

    curve = [[0, 0.5], [12, 0.75]]
    for seed, (warm, final) in enumerate([([1, 0], [1, 1]), ([0, 0], [1, 0])]):
        result = {**seed_result(seed, warm, final), "curve": curve, "heldout_success_base": 0.0}
        (tmp_path / f"seed-{seed}.json").write_text(json.dumps(result))
    outcome = CliRunner().invoke(
        app, ["bench", "learning", "--resume", str(tmp_path), "--seeds", "2", "--json"]
    )
    assert outcome.exit_code == 0, outcome.output
    summary = json.loads(outcome.output.strip().splitlines()[-1])
    assert summary["run_dir"] == str(tmp_path)
    assert summary["grpo_minus_warm_start"] == pytest.approx(0.5)
    assert summary["tasks_gained"] == 2 and summary["tasks_lost"] == 0
    refused = CliRunner().invoke(app, ["bench", "judge", "--resume", str(tmp_path)])
    assert refused.exit_code != 0 and "does not take --resume" in refused.output
