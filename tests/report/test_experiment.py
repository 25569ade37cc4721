"""The ablation's bookkeeping: statistics, aggregation of result files, resume, pacing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coevolve.cli import app
from coevolve.experiment.ablation import (
    ExperimentSpec,
    Pacer,
    arm_settings,
    code_version,
    pending,
    result_path,
    run_experiment,
)
from coevolve.experiment.aggregate import (
    load_results,
    mark_scores,
    paired_intervals,
    render_experiment_report,
    success_intervals,
)
from coevolve.report.stats import mean_interval, paired_bootstrap_interval

T_975_1DF = 12.706204736


def test_mean_interval_is_the_t_interval() -> None:
    interval = mean_interval([0.2, 0.4])

    assert interval.mean == pytest.approx(0.3)
    assert interval.low == pytest.approx(0.3 - T_975_1DF * 0.1, rel=1e-6)
    assert interval.high == pytest.approx(0.3 + T_975_1DF * 0.1, rel=1e-6)
    assert mean_interval([0.5]) == mean_interval([0.5, 0.5, 0.5]).__class__(0.5, 0.5, 0.5, 1)


def test_paired_bootstrap_spans_the_seeds_and_the_tasks() -> None:
    # one seed, two tasks: resampled means are 0, 0.5 or 1 (p = 1/4, 1/2, 1/4)
    over_tasks = paired_bootstrap_interval({0: [0.0, 1.0]})
    assert (over_tasks.mean, over_tasks.low, over_tasks.high) == (0.5, 0.0, 1.0)
    # constant within each seed: only the seed draw varies (0.25, 0.325 or 0.4)
    over_seeds = paired_bootstrap_interval({0: [0.25, 0.25], 1: [0.4, 0.4]})
    assert over_seeds.mean == pytest.approx(0.325)
    assert (over_seeds.low, over_seeds.high) == (0.25, 0.4)
    assert over_seeds.excludes_zero and not over_tasks.excludes_zero
    with pytest.raises(ValueError):
        paired_bootstrap_interval({})


def write_result(
    out: Path, arm: str, seed: int, scores: dict[str, float], code: str = "c0ffee"
) -> None:
    accuracy = sum(scores.values()) / len(scores)
    summary = {
        "learner_steps": 10 + seed,
        "policy_versions": 3,
        "signals_by_kind": {"boundary": 2} if arm == "coevolve" else {},
        "candidates": 4 if arm != "none" else 0,
        "accepted": 2 if arm != "none" else 0,
        "pool_by_origin": {"seed": 5, "synthesized": 2 if arm != "none" else 0},
        "stage_seconds": {"learner: training steps": 120.0},
    }
    result = {
        "arm": arm,
        "seed": seed,
        "minutes": 10.0,
        "code_version": code,
        "added_minutes": [3.0, 7.5] if arm != "none" else [],
        "marks": [
            {"minute": 10.0, "policy_version": 3, "eval": {"accuracy": accuracy, "scores": scores}}
        ],
        "summary": summary,
    }
    path = result_path(out, arm, seed)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))


@pytest.fixture
def experiment_dir(tmp_path: Path) -> Path:
    out = tmp_path / "ablation"
    per_seed = {
        0: {"coevolve": 0.75, "random": 0.5, "none": 0.5},
        1: {"coevolve": 0.9, "random": 0.5, "none": 0.25},
    }
    for seed, arms in per_seed.items():
        for arm, score in arms.items():
            write_result(out, arm, seed, {"t1": score, "t2": score})
    (out / "warm").mkdir()
    (out / "warm" / "eval-v1.json").write_text(
        json.dumps({"accuracy": 0.25, "scores": {"t1": 0.25, "t2": 0.25}})
    )
    return out


def test_aggregation_of_result_files(experiment_dir: Path) -> None:
    scores = mark_scores(load_results(experiment_dir), {"accuracy": 0.25, "scores": {}})
    success = success_intervals(scores)

    coevolve = success["coevolve"][10.0]
    assert coevolve.mean == pytest.approx(0.825)
    assert coevolve.high - coevolve.mean == pytest.approx(T_975_1DF * 0.075, rel=1e-6)
    assert success["none"][0.0].mean == 0.25  # the shared warm start
    better = paired_intervals(scores, "coevolve", "random")[10.0]
    assert (better.mean, better.low, better.high) == (pytest.approx(0.325), 0.25, 0.4)
    control = paired_intervals(scores, "random", "none")[10.0]
    assert control.mean == pytest.approx(0.125)
    assert (control.low, control.high) == (0.0, 0.25)
    assert 0.0 not in paired_intervals(scores, "coevolve", "random")


def test_experiment_report_renders(experiment_dir: Path) -> None:
    result = CliRunner().invoke(app, ["experiment", "report", str(experiment_dir)])

    assert result.exit_code == 0, result.output
    report_dir = experiment_dir / "report"
    text = (report_dir / "report.md").read_text()
    for name in ("heldout.png", "differences.png", "data_loop.png", "stages.png"):
        assert (report_dir / name).stat().st_size > 5_000, name
    assert "| coevolve - random | 10 | 0.325 [0.250, 0.400] (n=2) | yes |" in text
    assert "| random - none | 10 | 0.125 [0.000, 0.250] (n=2) | no |" in text
    assert "| 0 | 0.250 [0.250, 0.250] (n=2)" in text
    assert (
        "| coevolve | 2 | 10.5 ± 6.4 | 3.0 ± 0.0 | 2.0 ± 0.0 | 4.0 ± 0.0 | 0.500 | 2.0 ± 0.0 |"
        in text
    )
    assert "| none | 2 |" in text and "none yet" in text  # no candidates in none
    assert "Code: c0ffee." in text


def test_the_report_says_when_arms_ran_on_different_code(tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    write_result(out, "coevolve", 0, {"t1": 1.0}, code="c0ffee")
    write_result(out, "random", 0, {"t1": 0.0}, code="decade+dirty")
    text = render_experiment_report(out).read_text()
    assert "Code: c0ffee, decade+dirty (**arms ran on different code**)" in text


def test_report_of_an_empty_experiment(tmp_path: Path) -> None:
    text = render_experiment_report(tmp_path).read_text()

    assert "Held-out success: none yet." in text
    assert "Finished arm x seed: none yet." in text


def test_finished_arms_are_skipped(tmp_path: Path) -> None:
    spec = ExperimentSpec(("none", "random", "coevolve"), (0, 1), minutes=10.0)
    assert spec.plan()[:3] == [("coevolve", 0), ("random", 0), ("none", 0)]
    write_result(tmp_path, "coevolve", 0, {"t1": 1.0})
    write_result(tmp_path, "none", 1, {"t1": 1.0})

    assert pending(spec, tmp_path) == [("random", 0), ("none", 0), ("coevolve", 1), ("random", 1)]


def test_a_finished_experiment_starts_nothing(tmp_path: Path) -> None:
    spec = ExperimentSpec(("none", "coevolve"), (0,), minutes=10.0)
    for arm in spec.arms:
        write_result(tmp_path, arm, 0, {"t1": 1.0})

    assert run_experiment(spec, tmp_path, tmp_path / "base", log=lambda _: None) == []
    assert not (tmp_path / "warm").exists()
    with pytest.raises(ValueError, match=r"10\.0 min"):
        run_experiment(ExperimentSpec(("none",), (0,), minutes=5.0), tmp_path, tmp_path)


def test_marks_cover_the_run() -> None:
    assert ExperimentSpec(("none",), (0,), 25.0, eval_every_minutes=10.0).marks() == [
        10.0,
        20.0,
        25.0,
    ]
    assert ExperimentSpec(("none",), (0,), 3.0, eval_every_minutes=10.0).marks() == [3.0]


def test_pacer_matches_the_reference_curve_with_a_lead() -> None:
    pacer = Pacer([1.0, 1.5, 6.0], lead_minutes=2.0, in_flight_minutes=5.0, max_in_flight=2)

    assert pacer.requests_due(0.0) == 2  # two tasks due by minute 2
    assert pacer.requests_due(0.5) == 0  # both still in flight
    pacer.answered()
    pacer.answered()
    pacer.added = 2
    assert pacer.requests_due(3.0) == 0  # caught up
    assert pacer.requests_due(4.5) == 1  # the third is due by 6.5
    assert pacer.requests_due(9.0) == 0  # in flight until 9.5
    assert pacer.requests_due(9.6) == 1  # expired unanswered: ask again
    assert pacer.sent == 4


def test_arms_differ_only_in_synthesis() -> None:
    assert arm_settings("none", 1)[1] == ["explorer=0"]
    random_config, random_scale = arm_settings("random", 1)
    assert random_config["services"]["signal_monitor"]["detectors"]["kinds"] == []
    assert random_scale == []
    assert arm_settings("coevolve", 1) == (
        {"services": {"signal_monitor": {"detectors": {"reservoir_seed": 1}}}},
        [],
    )


def test_arms_lay_their_settings_over_the_base_configuration() -> None:
    base: dict[str, Any] = {
        "services": {
            "learner": {"grpo": {"lr": 1e-5}},
            "signal_monitor": {"detectors": {"threshold": 0.3, "kinds": ["rare"]}},
        }
    }
    config, _ = arm_settings("random", 2, base)

    assert config["services"]["learner"] == {"grpo": {"lr": 1e-5}}
    assert config["services"]["signal_monitor"]["detectors"] == {
        "threshold": 0.3,
        "kinds": [],
        "reservoir_seed": 2,
    }
    assert base["services"]["signal_monitor"]["detectors"]["kinds"] == ["rare"]  # untouched


def test_code_version_names_the_package_trees() -> None:
    version = code_version()
    if version is None:
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", version)
    assert code_version("no-such-commit") is None
