"""``coevolve report``: a synthetic run directory, written with the real writers."""

from __future__ import annotations

import time
from pathlib import Path

from typer.testing import CliRunner

from coevolve.cli import app
from coevolve.report import plots
from coevolve.report.run_data import RunData, SpanRow, StepGroup, StepRecord, TaskRow, load_run
from coevolve.report.run_report import (
    _uniform_share_series,
    render_run_report,
    role_llm_seconds,
    run_markdown,
    summarize_run,
)
from coevolve.services.distiller.actor import outcome_name
from coevolve.services.distiller.config import DISTIL_SPAN, OUTCOME_ATTRIBUTE
from coevolve.shared.messages import Experience
from coevolve.shared.runtime.telemetry import JsonlSpanExporter
from coevolve.shared.structured import Rejection
from tests.report.conftest import SyntheticRun
from tests.support.messages import experience

PLOTS = ("learning.png", "signals.png", "pool.png", "verdicts.png", "stages.png")


def test_summary_counts_what_the_run_wrote(synthetic_run: SyntheticRun) -> None:
    summary = summarize_run(load_run(synthetic_run.run_dir))

    assert summary.policy_versions == 3 and summary.latest_policy == 3
    assert summary.learner_steps == 3
    assert summary.groups_trained == 8  # the step without an update saw 2
    assert summary.groups_recorded == 3
    assert summary.uniform_share == 2 / 3
    assert summary.signals_by_kind == {"boundary": 4, "rare": 2}
    assert summary.candidates == 4 and summary.accepted == 2
    assert summary.acceptance_rate == 0.5
    assert summary.pool_by_origin == {"seed": 5, "synthesized": 2}
    assert summary.pool_growth == 2
    assert (summary.reward_first, summary.reward_last) == (0.125, 0.5)
    assert summary.top_reasons == [("ground truth fails", 2), ("duplicate of a pool task", 1)]
    assert summary.first_minutes["first signal"] == 1.5
    assert summary.first_minutes["first accepted task"] == 100 / 60
    # one clock: a task joins the pool with the verdict that accepts it, never before
    assert summary.first_minutes["first task added"] == 100 / 60
    assert summary.first_minutes["first verdict"] == 100 / 60
    assert summary.first_minutes["first GRPO step"] == 1.0
    assert summary.stage_seconds["learner: training steps"] == 61.0
    assert summary.stage_seconds["explorer: process coevolve.signals.boundary"] == 40.0
    assert summary.stage_seconds["judge: process coevolve.candidates"] == 4.5


def test_report_renders_plots_and_numbers(synthetic_run: SyntheticRun, tmp_path: Path) -> None:
    out = tmp_path / "report"
    report = render_run_report(synthetic_run.run_dir, out)

    for name in PLOTS:
        assert (out / name).stat().st_size > 5_000, name
        assert f"]({name})" in report.read_text()
    text = report.read_text()
    assert "| learner steps | 3 |" in text
    assert "| policy versions | 3 (latest v3) |" in text
    assert "| signals | 6 (boundary 4, rare 2) |" in text
    assert "| accepted | 2 (rate 0.5) |" in text
    assert "| pool | seed 5, synthesized 2 |" in text
    assert "| reward, first -> last trained step | 0.125 -> 0.5 |" in text
    assert "| first signal | 1.5 min |" in text
    assert "2 of 4 candidates accepted" in text
    assert "| ground truth fails | 2 |" in text
    assert "| rare | 2 | 1 | 3 |" in text  # emitted, received, suppressed
    assert "| judge | 1 | 2 | 1 | ERROR asyncio: the first failure |" in text
    assert "reward moved +0.375" in text
    assert "| learner |" not in text  # no log, no row


def test_a_run_with_nothing_but_a_seeded_pool_still_renders(pool_only_run: Path) -> None:
    report = render_run_report(pool_only_run)

    text = report.read_text()
    assert report.parent == pool_only_run / "report"
    assert "Verdicts: none yet." in text
    assert "Signals: none yet." in text
    assert "| pool | seed 4 |" in text
    assert "| first GRPO step | none yet |" in text
    assert "not training yet" in text
    for name in PLOTS:
        assert (report.parent / name).exists()


def test_an_empty_directory_renders_and_names_the_missing_pool(tmp_path: Path) -> None:
    text = render_run_report(tmp_path).read_text()

    assert "Pool file: no pool.duckdb." in text
    assert "| learner steps | 0 |" in text


def test_cli_writes_the_report_where_asked(synthetic_run: SyntheticRun, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"
    result = CliRunner().invoke(app, ["report", str(synthetic_run.run_dir), "--out", str(out)])

    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out / "report.md")
    assert (out / "learning.png").exists()


def test_uniform_share_per_learner_step_and_over_the_pool(synthetic_run: SyntheticRun) -> None:
    series = _uniform_share_series(load_run(synthetic_run.run_dir))

    minutes, shares = series["learner (per step)"]
    assert list(shares) == [0.0, 0.5, 0.0, 1.0]
    assert list(minutes) == [1.0, 2.0, 3.0, 200 / 60]
    assert list(series["pool (all groups so far)"][1]) == [0.0, 0.5, 2 / 3]


def test_a_count_axis_starts_at_zero_with_whole_numbers_even_when_nothing_was_added() -> None:
    _, (flat, rising) = plots.panels(2)
    plots.lines(flat, {"added": ([0.0, 8.0], [0, 0])}, title="t", step=True, counts=True)
    plots.lines(rising, {"added": ([0.0, 2.0, 8.0], [0, 3, 3])}, title="t", step=True, counts=True)
    assert flat.get_ylim() == (0.0, 1.0)
    assert rising.get_ylim()[0] == 0.0 and rising.get_ylim()[1] >= 3
    for ax in (flat, rising):
        assert all(float(tick).is_integer() for tick in ax.get_yticks())


def test_tasks_drafted_long_before_the_run_do_not_set_its_clock(tmp_path: Path) -> None:
    """A D0 task was drafted days before the run that trains on it, and no verdict of the
    run added it: it is there from the start (minute 0), and the run's clock starts at its
    first event, not at the draft."""
    from coevolve.services.pool_store.store import PoolStore
    from coevolve.shared.messages import RolloutResults, ScoreSample, Task

    day_ago = time.time() - 86_400
    with PoolStore(tmp_path / "pool.duckdb") as store:
        store.add_tasks(
            [Task(id="d0-1", environment="bfcl", user_turns=["List users."], created_at=day_ago)]
        )
        sample = ScoreSample(task_id="d0-1", policy_version=1, score=0.0, length=3)
        store.record_results(RolloutResults(group_id="g1", samples=[sample]))
    data = load_run(tmp_path)
    assert [task.added_at for task in data.tasks] == [0.0]
    assert data.origin > day_ago + 3600
    assert data.duration_s() < 3600


def test_role_llm_seconds_sum_the_labelling_of_every_group_and_the_distiller_spans(
    tmp_path: Path,
) -> None:
    def group(name: str, label_s: float) -> StepGroup:
        return StepGroup(name, "t", "seed", 1, uniform=False, label_s=label_s, labelled=8)

    data = RunData(run_dir=tmp_path)
    data.steps = [
        StepRecord(1, 2, True, 0.0, (group("a", 40.0), group("b", 7.5)), (group("c", 2.5),)),
        StepRecord(2, 3, True, 9.0, (group("d", 10.0),), ()),
    ]
    data.spans = [
        SpanRow("distiller", DISTIL_SPAN, 0.0, 12.0),
        SpanRow("distiller", DISTIL_SPAN, 30.0, 3.0),
        SpanRow("explorer", "explorer substitute", 0.0, 99.0),
    ]

    # a stale group was labelled too: its seconds count
    assert role_llm_seconds(data) == {"attributor": 60.0, "distiller": 15.0}
    assert role_llm_seconds(RunData(run_dir=tmp_path)) == {}


def test_a_no_label_runs_starting_pool_is_not_growth(tmp_path: Path) -> None:
    data = RunData(run_dir=tmp_path)
    data.tasks = [
        TaskRow(0.0, "explored", "d0-1"),  # committed D0 tasks: no verdict added them
        TaskRow(0.0, "explored", "d0-2"),
        TaskRow(120.0, "synthesized", "child", parent_task_id="d0-1"),
    ]
    summary = summarize_run(data)

    assert summary.pool_by_origin == {"explored": 2, "synthesized": 1}
    assert summary.tasks_added == summary.pool_growth == 1


def test_the_report_counts_the_advice_the_distiller_dropped_by_reason(tmp_path: Path) -> None:
    """The distiller's spans, written by the real exporter, name what became of each
    piece of advice; the report counts those it did not keep."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "distiller"}))
    exporter = JsonlSpanExporter(tmp_path / "traces" / "distiller-1-abcdef.jsonl")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    kept = experience("When asked to list, call ls.")
    outcomes: list[Experience | Rejection] = [
        Rejection("incomplete", "it ends mid-sentence"),
        Rejection("unknown_argument", "send_message has no argument symbol"),
        kept,
        Rejection("incomplete", "an unclosed bracket"),
    ]
    for outcome in outcomes:
        with tracer.start_as_current_span(DISTIL_SPAN) as span:
            span.set_attribute(OUTCOME_ATTRIBUTE, outcome_name(outcome))
    provider.shutdown()

    data = load_run(tmp_path)
    summary = summarize_run(data)
    assert summary.experiences_dropped == {"incomplete": 2, "unknown_argument": 1}
    assert (
        "kept no experience from rollout groups, and dropped 3 (incomplete 2, "
        "unknown_argument 1)." in run_markdown(data, summary)
    )
    assert "## Experiences" not in run_markdown(
        RunData(run_dir=tmp_path), summarize_run(RunData(run_dir=tmp_path))
    )
