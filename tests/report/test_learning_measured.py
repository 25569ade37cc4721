"""``coevolve report`` shows only what the run measured: the KL panel only when the learner
computed a KL, the held-out panel only when an evaluator wrote ``eval/`` scalars, and the
share of groups the learner dropped as stale from its step records."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from coevolve.report.run_data import load_run
from coevolve.report.run_report import (
    HELD_OUT_PANEL,
    KL_NOT_COMPUTED,
    KL_PANEL,
    HeldOut,
    held_out_lines,
    learning_panels,
    render_run_report,
    summarize_run,
)
from coevolve.services.learner.handler import STEPS_FILE
from tests.report.conftest import T0, SyntheticRun
from tests.support.learner_steps import record_step
from tests.support.messages import rewarded_group

STALE_ROW = "stale-and-dropped share (learner: groups dropped stale / groups received)"
WAITING_ROW = "groups waiting untrained at the end (in the pool, in no learner step)"
HELD_OUT_ROW = "held-out accuracy (evaluator), first -> last evaluated version"


def learner_run(run: Path, kl: float | None) -> Path:
    """Three trained learner steps; ``learner/kl`` logged as ``kl`` at each, or not at all."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run / "tensorboard" / "learner"))
    for step in (1, 2, 3):
        values = {"reward_mean": 0.1 * step, "staleness_mean": 0.5, "groups": 2.0, "trained": 1.0}
        if kl is not None:
            values["kl"] = kl
        for tag, value in values.items():
            writer.add_scalar(f"learner/{tag}", value, step, walltime=T0 + 60.0 * step)
    writer.close()
    return run


def write_eval(directory: Path, scores: dict[int, dict[str, float]]) -> None:
    """Each version's scalars by a writer of its own, as the evaluator writes them."""
    from torch.utils.tensorboard import SummaryWriter

    for version, measures in scores.items():
        writer = SummaryWriter(str(directory), filename_suffix=f".v{version}")
        for tag, value in measures.items():
            writer.add_scalar(tag, value, version, walltime=T0 + 100.0 * version)
        writer.close()


@pytest.mark.parametrize("kl", [0.0, None], ids=["all-zero", "absent"])
def test_no_kl_panel_when_no_kl_was_computed(tmp_path: Path, kl: float | None) -> None:
    run = learner_run(tmp_path / "run", kl)

    panels = learning_panels(load_run(run))
    text = render_run_report(run).read_text()

    assert KL_PANEL not in panels
    assert [title for _, title in panels] == [
        "reward (mean per step)",
        "staleness (policy versions behind)",
        "uniform-group share (no gradient)",
    ]
    assert f"{KL_NOT_COMPUTED}: no KL panel." in text
    assert "Reward and staleness are the learner's TensorBoard scalars" in text
    assert "KL and staleness" not in text
    assert (run / "report" / "learning.png").stat().st_size > 5_000


def test_kl_panel_when_the_learner_measured_a_kl(synthetic_run: SyntheticRun) -> None:
    panels = learning_panels(load_run(synthetic_run.run_dir))
    text = render_run_report(synthetic_run.run_dir).read_text()

    assert KL_PANEL in panels
    assert "Reward, KL and staleness are the learner's TensorBoard scalars" in text
    assert KL_NOT_COMPUTED not in text


def test_stale_and_dropped_share_from_the_step_records(synthetic_run: SyntheticRun) -> None:
    """The pool holds groups g1, g2 and g3; the learner received four groups, dropped two
    as stale (g2, and one the pool never recorded) and no step named g3."""
    run = synthetic_run.run_dir
    for groups, (step, version, before) in (
        ([rewarded_group("g1", "task-0", "seed", 1, 0.0, 1.0)], (1, 4, 3)),
        (
            [
                rewarded_group("g2", "task-0", "seed", 1, 0.0, 0.0),
                rewarded_group("g-old", "task-1", "seed", 1, 0.0, 1.0),
            ],
            (2, 5, 4),
        ),
        ([rewarded_group("g4", "task-0", "seed", 5, 0.0, 1.0)], (3, 6, 5)),
    ):
        record_step(
            run / STEPS_FILE, groups, step=step, versions=(before, version), at=T0 + 60 * step
        )

    summary = summarize_run(load_run(run))
    text = render_run_report(run).read_text()

    # v1 groups: within 2 versions of v3 (step 1), beyond it from v4 (step 2)
    assert (summary.groups_received, summary.groups_stale) == (4, 2)
    assert summary.stale_share == 0.5
    assert summary.groups_waiting == 1  # g3
    assert asdict(summary)["stale_share"] == 0.5
    assert f"| {STALE_ROW} | 0.5 (2 of 4) |" in text
    assert f"| {WAITING_ROW} | 1 |" in text
    uniform_row = text.index("| uniform-group share (pool: groups whose rewards were all equal)")
    assert text.index(f"| {STALE_ROW}") > uniform_row


def test_no_step_records_say_the_stale_share_is_not_recorded(
    synthetic_run: SyntheticRun,
) -> None:
    summary = summarize_run(load_run(synthetic_run.run_dir))
    text = render_run_report(synthetic_run.run_dir).read_text()

    assert summary.stale_share is None and summary.groups_waiting is None
    assert f"| {STALE_ROW} | not recorded (no learner/steps.jsonl) |" in text


def test_held_out_panel_and_row_when_the_evaluator_wrote_scalars(
    synthetic_run: SyntheticRun,
) -> None:
    run = synthetic_run.run_dir
    write_eval(
        run / "tensorboard" / "evaluator",
        {
            version: {
                "eval/accuracy": accuracy,
                "eval/ci95_low": accuracy - 0.125,
                "eval/ci95_high": accuracy + 0.125,
                "eval/partial_credit_mean": accuracy + 0.25,
                "eval/seconds_per_entry": 12.0,
            }
            for version, accuracy in ((1, 0.25), (2, 0.375), (3, 0.5))
        },
    )

    data = load_run(run)
    summary = summarize_run(data)
    text = render_run_report(run).read_text()

    assert learning_panels(data)[-1] == HELD_OUT_PANEL
    # shares are lines, the interval a band; seconds are not on an accuracy axis
    assert held_out_lines(data) == ["eval/accuracy", "eval/partial_credit_mean"]
    assert len(summary.eval_tags) == 5
    assert (summary.held_out_first, summary.held_out_last) == (HeldOut(1, 0.25), HeldOut(3, 0.5))
    assert json.loads(json.dumps(asdict(summary)))["held_out_last"] == {
        "version": 3,
        "accuracy": 0.5,
    }
    assert f"| {HELD_OUT_ROW} | v1 0.25 -> v3 0.5 |" in text
    assert "(`eval/accuracy`, `eval/partial_credit_mean`; the band: `eval/ci95_low`" in text
    assert "Not drawn (not shares): `eval/seconds_per_entry`." in text


def test_eval_scalars_in_the_learner_directory_count_too(tmp_path: Path) -> None:
    run = learner_run(tmp_path / "run", 0.02)
    write_eval(
        run / "tensorboard" / "learner", {2: {"eval/accuracy": 0.5}, 4: {"eval/accuracy": 0.75}}
    )

    data = load_run(run)

    assert learning_panels(data)[-1] == HELD_OUT_PANEL
    assert summarize_run(data).held_out_last == HeldOut(4, 0.75)
    assert len(data.scalars["eval/accuracy"]) == 2  # read once, not once per directory


def test_no_held_out_panel_or_row_without_eval_scalars(synthetic_run: SyntheticRun) -> None:
    data = load_run(synthetic_run.run_dir)
    text = render_run_report(synthetic_run.run_dir).read_text()

    assert HELD_OUT_PANEL not in learning_panels(data)
    assert summarize_run(data).eval_tags == []
    assert HELD_OUT_ROW not in text
    assert "Held-out accuracy" not in text
