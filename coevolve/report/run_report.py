"""``coevolve report RUN_DIR``: one run as Markdown with PNG plots.

The summary table comes first (is the loop alive, is it learning), then one section per
part of the loop: learning (reward, KL when computed, staleness, uniform groups, held-out
accuracy when an evaluator measured it), signals, pool growth,
draws (rollout groups per origin and how concentrated they are), exposure (how much of
the training is on synthesized tasks, and how soon a child of a signal is first drawn:
``coevolve/report/exposure.py``), verdicts, repair (did training on a child raise its
parent: ``coevolve/report/repair.py``), and the time each stage took. A part with no
data says "none yet".
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevolve.report import plots
from coevolve.report.accepted import (
    ACCEPTED_FILE,
    accepted_rows,
    accepted_summary,
    write_accepted_rows,
)
from coevolve.report.exposure import exposure, exposure_text, write_exposure
from coevolve.report.hard_negatives import HardNegatives, hard_negatives, hard_negatives_text
from coevolve.report.repair import (
    MEASURED_FILE,
    NO_SIGNAL,
    ChildRow,
    Scores,
    child_rows,
    draw_rows,
    parent_groups,
    read_measured,
)
from coevolve.report.run_data import (
    EVAL_PREFIX,
    POOL_FILE,
    RunData,
    Scalar,
    StepGroup,
    load_run,
)
from coevolve.services.distiller.config import DISTIL_SPAN, KEPT

if TYPE_CHECKING:
    from matplotlib.axes import Axes

REPORT_FILE = "report.md"
KL_TAG = "learner/kl"
UNIFORM_SHARE = "uniform_share"
HELD_OUT = "held_out"
REWARD_PANEL = ("learner/reward_mean", "reward (mean per step)")
KL_PANEL = (KL_TAG, "KL to the reference")
STALENESS_PANEL = ("learner/staleness_mean", "staleness (policy versions behind)")
UNIFORM_PANEL = (UNIFORM_SHARE, "uniform-group share (no gradient)")
HELD_OUT_PANEL = (HELD_OUT, "held-out accuracy (evaluator)")
HELD_OUT_TAG = f"{EVAL_PREFIX}accuracy"
# the evaluator's 95% interval of the accuracy, drawn as a band (services/evaluator)
HELD_OUT_BAND = (f"{EVAL_PREFIX}ci95_low", f"{EVAL_PREFIX}ci95_high")
KL_NOT_COMPUTED = "KL not computed (kl_beta 0)"
TOP_REASONS = 8
NONE_YET = "none yet"
CHILD_ROWS = 100  # accepted tasks listed in the repair section at most


@dataclass(frozen=True)
class HeldOut:
    """The evaluator's held-out accuracy at one policy version."""

    version: int
    accuracy: float


@dataclass
class RunSummary:
    """The headline numbers of a run (also what the experiment report compares)."""

    minutes: float
    policy_versions: int
    latest_policy: int | None
    learner_steps: int
    groups_trained: int
    groups_recorded: int
    uniform_share: float | None
    signals_by_kind: dict[str, int]
    candidates: int
    accepted: int
    pool_by_origin: dict[str, int]
    reward_first: float | None
    reward_last: float | None
    first_minutes: dict[str, float | None] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    top_reasons: list[tuple[str, int]] = field(default_factory=list)
    # from learner/steps.jsonl (None: not recorded): groups the learner received, those it
    # dropped beyond its staleness bound, and pool groups in no step at the end
    groups_received: int | None = None
    groups_stale: int | None = None
    stale_share: float | None = None
    groups_waiting: int | None = None
    # the evaluator's eval/ tags, and its held-out accuracy at the first and last version
    eval_tags: list[str] = field(default_factory=list)
    held_out_first: HeldOut | None = None
    held_out_last: HeldOut | None = None
    # the mechanisms' role-LLM seconds ("attributor": step credit's labelling, "distiller":
    # self-navigating's distillation) and the experiences the distiller drew
    role_llm_seconds: dict[str, float] = field(default_factory=dict)
    experiences: int = 0
    # advice the distiller did not keep, by reason (its spans' outcomes)
    experiences_dropped: dict[str, int] = field(default_factory=dict)
    # the failure agent's failures against the target's on the same tasks (None: no
    # failure agent, or none of its failures on a task the target failed)
    hard_negatives: HardNegatives | None = None
    # tasks this run added (not from its starting pool, ``TaskRow.from_start``)
    tasks_added: int | None = None

    @property
    def signals(self) -> int:
        return sum(self.signals_by_kind.values())

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.candidates if self.candidates else None

    @property
    def pool_growth(self) -> int:
        """Tasks this run's verdicts added (``tasks_added``); for a summary written before
        that was recorded, every task not of the seed origin."""
        if self.tasks_added is not None:
            return self.tasks_added
        return sum(n for origin, n in self.pool_by_origin.items() if origin != "seed")


def summarize_run(data: RunData) -> RunSummary:
    versions = data.policy_versions()
    trained = data.scalars.get("learner/groups", [])
    rewards = _trained_points(data, "learner/reward_mean")
    uniform = [g.uniform for g in data.groups]
    signal_times = [t for t, _ in data.signal_events()]
    accepted = [v for v in data.verdicts if v.accepted]
    grown = [t.added_at for t in data.tasks if not t.from_start]
    trained_at = [p.wall_time for p in data.scalars.get("learner/trained", []) if p.value > 0]
    first = {
        "policy v1 (warm start)": data.policy_files.get(1),
        "first rollout group": min((g.recorded_at for g in data.groups), default=None),
        "first GRPO step": min(trained_at, default=None),
        "first signal": min(signal_times, default=None),
        "first verdict": data.verdicts[0].created_at if data.verdicts else None,
        "first accepted task": accepted[0].created_at if accepted else None,
        "first task added": min(grown, default=None),
    }
    reasons = Counter(r for v in data.verdicts if not v.accepted for r in v.reasons)
    received, stale = learner_intake(data) or (None, None)
    held_out = held_out_points(data, HELD_OUT_TAG)
    return RunSummary(
        minutes=data.duration_s() / 60.0,
        policy_versions=len(versions),
        latest_policy=versions[-1] if versions else None,
        learner_steps=data.learner_steps(),
        groups_trained=int(sum(p.value for p in trained)),
        groups_recorded=len(data.groups),
        uniform_share=sum(uniform) / len(uniform) if uniform else None,
        signals_by_kind=data.signals_by_kind(),
        candidates=len(data.verdicts),
        accepted=len(accepted),
        pool_by_origin=dict(Counter(t.origin for t in data.tasks)),
        reward_first=rewards[0].value if rewards else None,
        reward_last=rewards[-1].value if rewards else None,
        first_minutes={k: None if v is None else data.minutes(v) for k, v in first.items()},
        stage_seconds=stage_seconds(data),
        top_reasons=reasons.most_common(TOP_REASONS),
        groups_received=received,
        groups_stale=stale,
        stale_share=stale / received if stale is not None and received else None,
        groups_waiting=groups_waiting(data),
        eval_tags=eval_tags(data),
        held_out_first=HeldOut(*held_out[0]) if held_out else None,
        held_out_last=HeldOut(*held_out[-1]) if held_out else None,
        role_llm_seconds=role_llm_seconds(data),
        experiences=len(data.experiences),
        experiences_dropped=experiences_dropped(data),
        hard_negatives=hard_negatives(data),
        tasks_added=len(grown),
    )


def role_llm_seconds(data: RunData) -> dict[str, float]:
    """Role-LLM seconds of the optional mechanisms: the attributor's labelling of every
    group a step received (stale ones too: they were labelled) and the distiller's spans."""
    labelled = [g for step in data.steps for g in (*step.groups, *step.stale)]
    seconds = {
        "attributor": sum(g.label_s for g in labelled),
        "distiller": sum(s.seconds for s in data.spans if s.name == DISTIL_SPAN),
    }
    return {role: round(value, 1) for role, value in seconds.items() if value}


def experiences_dropped(data: RunData) -> dict[str, int]:
    """Advice the distiller drew but did not keep, by reason, most frequent first."""
    dropped = Counter(
        s.outcome for s in data.spans if s.name == DISTIL_SPAN and s.outcome not in (None, KEPT)
    )
    return {str(reason): count for reason, count in dropped.most_common()}


def learner_intake(data: RunData) -> tuple[int, int] | None:
    """(groups the learner's steps received, of them those dropped as stale); None
    without step records."""
    if not data.steps:
        return None
    stale = sum(len(step.stale) for step in data.steps)
    return sum(len(step.groups) for step in data.steps) + stale, stale


def groups_waiting(data: RunData) -> int | None:
    """Pool groups that no learner step names (not yet trained on, nor dropped, when the
    run's files were read); None unless both the pool and the step records are there."""
    if not data.steps or not data.groups or data.pool_error:
        return None
    seen = {g.group_id for step in data.steps for g in (*step.groups, *step.stale)}
    return sum(1 for group in data.groups if group.group_id not in seen)


def kl_computed(data: RunData) -> bool:
    """Whether the learner measured a KL: it writes ``learner/kl`` only when ``kl_beta``
    is above 0; older runs wrote zeros regardless, so an all-zero series counts as none."""
    return any(point.value != 0 for point in data.scalars.get(KL_TAG, []))


def eval_tags(data: RunData) -> list[str]:
    """The evaluator's tags with at least one point, sorted."""
    return sorted(t for t, points in data.scalars.items() if t.startswith(EVAL_PREFIX) and points)


def held_out_points(data: RunData, tag: str) -> list[tuple[int, float]]:
    """(policy version, value) of an ``eval/`` tag by version; a version evaluated twice
    keeps its latest value."""
    by_version: dict[int, Scalar] = {}
    for point in data.scalars.get(tag, []):
        kept = by_version.get(point.step)
        if kept is None or point.wall_time >= kept.wall_time:
            by_version[point.step] = point
    return [(version, by_version[version].value) for version in sorted(by_version)]


def held_out_lines(data: RunData) -> list[str]:
    """The ``eval/`` tags drawn as lines in the held-out panel: shares (every value in
    [0, 1]); not the accuracy's interval (a band), nor seconds or log-probs."""
    return [
        tag
        for tag in eval_tags(data)
        if tag not in HELD_OUT_BAND and all(0 <= p.value <= 1 for p in data.scalars[tag])
    ]


def learning_panels(data: RunData) -> list[tuple[str, str]]:
    """(tag, title) of each learning panel: only what the run measured."""
    panels = [REWARD_PANEL]
    if kl_computed(data):
        panels.append(KL_PANEL)
    panels += [STALENESS_PANEL, UNIFORM_PANEL]
    if eval_tags(data):
        panels.append(HELD_OUT_PANEL)
    return panels


def _trained_points(data: RunData, tag: str) -> list[Scalar]:
    """The points of ``tag`` from learner steps that trained. A step without an update
    logs too (its zeros are not rewards), under the same step number as the last update,
    so points pair with ``learner/trained`` by position: every step logs every tag."""
    trained = data.scalars.get("learner/trained", [])
    points = data.scalars.get(tag, [])
    if len(trained) == len(points):
        return [p for p, t in zip(points, trained, strict=True) if t.value > 0]
    steps = {t.step for t in trained if t.value > 0}
    return [p for p in points if p.step in steps] if steps else points


def stage_seconds(data: RunData) -> dict[str, float]:
    """Seconds per stage: summed span durations per ``service: span``, and the learner's
    training steps (their ``duration_s`` scalars). Inner spans (``explorer explore``) are
    part of the handler span that contains them."""
    totals: dict[str, float] = defaultdict(float)
    for span in data.spans:
        name = span.name.removeprefix(f"{span.service} ")
        totals[f"{span.service}: {name}"] += span.seconds
    steps = data.scalars.get("learner/duration_s", [])
    if steps:
        totals["learner: training steps"] += sum(p.value for p in steps)
    ordered = sorted(totals.items(), key=lambda kv: -kv[1])
    return {k: round(v, 1) for k, v in ordered}


# ---------------------------------------------------------------------- plots


def plot_learning(data: RunData, path: Path) -> Path:
    """The learner's panels over the same minutes (the whole run), so they line up; the
    held-out panel, when there is one, over the policy versions evaluated."""
    chosen = learning_panels(data)
    figure, axes = plots.panels(len(chosen))
    end = max(data.minutes(data.origin + data.duration_s()), 1.0)
    for ax, (tag, title) in zip(axes, chosen, strict=True):
        if tag == HELD_OUT:
            _plot_held_out(ax, data, title)
            continue
        if tag == UNIFORM_SHARE:
            series = _uniform_share_series(data)
        else:
            points = _trained_points(data, tag)
            series = {
                "learner": ([data.minutes(p.wall_time) for p in points], [p.value for p in points])
            }
        if tag == "learner/reward_mean" and data.groups:
            series["rollout groups (mean score, last 20)"] = _rolling_group_scores(data)
        plots.lines(ax, series, title=title, marker="o")
        if any(len(xs) for xs, _ in series.values()):
            ax.set_xlim(-0.02 * end, end * 1.02)
    return plots.save(figure, path)


def _plot_held_out(ax: Axes, data: RunData, title: str) -> None:
    series: dict[str, plots.Series] = {}
    for tag in held_out_lines(data):
        points = held_out_points(data, tag)
        series[tag.removeprefix(EVAL_PREFIX)] = (
            [float(version) for version, _ in points],
            [value for _, value in points],
        )
    plots.lines(ax, series, title=title, xlabel="policy version", marker="o", legend=True)
    low, high = (dict(held_out_points(data, tag)) for tag in HELD_OUT_BAND)
    versions = sorted(set(low) & set(high))
    if series and versions:
        plots.interval(
            ax,
            [float(v) for v in versions],
            [low[v] for v in versions],
            [high[v] for v in versions],
            label="accuracy 95% interval",
        )
        ax.legend(fontsize=8)
    plots.whole_number_x(ax)


def _uniform_share_series(data: RunData) -> dict[str, plots.Series]:
    groups = data.scalars.get("learner/groups", [])
    uniform = data.scalars.get("learner/uniform_groups", [])
    xs, ys = [], []
    if len(groups) == len(uniform):  # one point of each per learner step
        for seen, flat in zip(groups, uniform, strict=True):
            if seen.value > 0:
                xs.append(data.minutes(seen.wall_time))
                ys.append(flat.value / seen.value)
    series: dict[str, plots.Series] = {"learner (per step)": (xs, ys)}
    if data.groups:
        running = 0
        pool_x, pool_y = [], []
        for index, group in enumerate(data.groups, start=1):
            running += group.uniform
            pool_x.append(data.minutes(group.recorded_at))
            pool_y.append(running / index)
        series["pool (all groups so far)"] = (pool_x, pool_y)
    return series


def _rolling_group_scores(data: RunData, window: int = 20) -> plots.Series:
    xs, ys = [], []
    scores: list[float] = []
    for group in data.groups:
        scores.append(group.mean_score)
        recent = scores[-window:]
        xs.append(data.minutes(group.recorded_at))
        ys.append(sum(recent) / len(recent))
    return xs, ys


def plot_signals(data: RunData, path: Path) -> Path:
    figure, (over_time, totals) = plots.panels(2)
    end = data.minutes(data.origin + data.duration_s())
    by_kind: dict[str, list[float]] = {}
    for at, kind in data.signal_events():
        by_kind.setdefault(kind, []).append(data.minutes(at))
    _cumulative_counts(
        over_time,
        by_kind,
        end,
        title="signals received by the explorer (cumulative)",
        ylabel="signals",
    )
    plots.bars(
        totals,
        {k: float(v) for k, v in data.signals_by_kind().items()},
        title="signals by kind (total)",
    )
    return plots.save(figure, path)


def plot_pool(data: RunData, path: Path) -> Path:
    figure, (size, growth) = plots.panels(2)
    end = data.minutes(data.origin + data.duration_s())
    times = [data.minutes(t.added_at) for t in data.tasks]
    plots.lines(
        size,
        {"all origins": plots.cumulative(times, end=end)} if times else {},
        title="pool size",
        ylabel="tasks",
        step=True,
    )
    by_origin: dict[str, list[float]] = {}
    for task in data.tasks:
        if not task.from_start:  # a no-label run's starting pool D0 is not growth
            by_origin.setdefault(task.origin, []).append(data.minutes(task.added_at))
    _cumulative_counts(
        growth, by_origin, end, title="tasks added by origin (cumulative)", ylabel="tasks"
    )
    return plots.save(figure, path)


def _cumulative_counts(
    ax: Axes, times_by_name: dict[str, list[float]], end: float, *, title: str, ylabel: str
) -> None:
    """One step line per name: how many of it came by each minute, up to ``end``."""
    plots.lines(
        ax,
        {name: plots.cumulative(times, end=end) for name, times in sorted(times_by_name.items())},
        title=title,
        ylabel=ylabel,
        step=True,
        legend=True,
        counts=True,
    )


def plot_verdicts(data: RunData, summary: RunSummary, path: Path) -> Path:
    figure, (over_time, reasons) = plots.panels(2)
    accepted = [data.minutes(v.created_at) for v in data.verdicts if v.accepted]
    rejected = [data.minutes(v.created_at) for v in data.verdicts if not v.accepted]
    end = data.minutes(data.origin + data.duration_s())
    series = {
        "accepted": plots.cumulative(accepted, end=end),
        "rejected": plots.cumulative(rejected, end=end),
    }
    if not data.verdicts:
        series = {}
    plots.lines(
        over_time,
        series,
        title="verdicts (cumulative)",
        ylabel="candidates",
        step=True,
        counts=True,
    )
    plots.bars(
        reasons,
        {reason: float(n) for reason, n in summary.top_reasons},
        title="top rejection reasons",
        xlabel="rejections",
    )
    return plots.save(figure, path)


def plot_stages(summary: RunSummary, path: Path, top: int = 14) -> Path:
    figure, (ax,) = plots.panels(1, columns=1)
    figure.set_size_inches(9, 4)
    chosen = dict(list(summary.stage_seconds.items())[:top])
    plots.bars(
        ax,
        {k: v / 60.0 for k, v in chosen.items()},
        title="time per stage",
        xlabel="minutes (summed over spans)",
    )
    return plots.save(figure, path)


# ---------------------------------------------------------------------- markdown


def fmt(value: float | int | None, digits: int = 3) -> str:
    if value is None:
        return NONE_YET
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def fmt_minutes(value: float | None) -> str:
    return NONE_YET if value is None else f"{value:.1f} min"


def summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    pool = summary.pool_by_origin
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary.signals_by_kind.items()))
    rows = [
        ("run length (first to last event)", fmt_minutes(summary.minutes)),
        (
            "policy versions",
            f"{summary.policy_versions} (latest v{summary.latest_policy})"
            if summary.latest_policy is not None
            else NONE_YET,
        ),
        ("learner steps", str(summary.learner_steps)),
        (
            "groups seen by the learner / recorded in the pool",
            f"{summary.groups_trained} / {summary.groups_recorded}",
        ),
        (
            "uniform-group share (pool: groups whose rewards were all equal)",
            fmt(summary.uniform_share),
        ),
        (
            "stale-and-dropped share (learner: groups dropped stale / groups received)",
            f"{fmt(summary.stale_share)} ({summary.groups_stale} of {summary.groups_received})"
            if summary.stale_share is not None
            else _not_recorded(summary.groups_received),
        ),
        (
            "groups waiting untrained at the end (in the pool, in no learner step)",
            str(summary.groups_waiting)
            if summary.groups_waiting is not None
            else _not_recorded(summary.groups_received),
        ),
        (
            "reward, first -> last trained step",
            f"{fmt(summary.reward_first)} -> {fmt(summary.reward_last)}"
            if summary.reward_first is not None
            else NONE_YET,
        ),
        *_held_out_rows(summary),
        ("signals", f"{summary.signals}" + (f" ({kinds})" if kinds else "")),
        ("candidates judged", str(summary.candidates)),
        (
            "accepted",
            f"{summary.accepted} (rate {fmt(summary.acceptance_rate)})"
            if summary.candidates
            else NONE_YET,
        ),
        (
            "pool",
            ", ".join(f"{k} {v}" for k, v in sorted(pool.items())) if pool else NONE_YET,
        ),
        ("pool growth (tasks this run added)", str(summary.pool_growth)),
    ]
    rows += [(name, fmt_minutes(at)) for name, at in summary.first_minutes.items()]
    return rows


def _not_recorded(received: int | None) -> str:
    return "not recorded (no learner/steps.jsonl)" if received is None else NONE_YET


def _held_out_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """The held-out accuracy row: only when the evaluator wrote any ``eval/`` scalar."""
    if not summary.eval_tags:
        return []
    first, last = summary.held_out_first, summary.held_out_last
    value = (
        f"v{first.version} {fmt(first.accuracy)} -> v{last.version} {fmt(last.accuracy)}"
        if first is not None and last is not None
        else f"no {HELD_OUT_TAG} scalar"
    )
    return [("held-out accuracy (evaluator), first -> last evaluated version", value)]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def health_lines(summary: RunSummary) -> list[str]:
    """Two plain sentences: is the loop alive, is the policy learning."""
    alive = summary.learner_steps > 0 and summary.groups_recorded > 0
    synthesizing = summary.candidates > 0
    loop = "alive" if alive else "not training yet"
    data = (
        f"the data loop has judged {summary.candidates} candidates ({summary.accepted} accepted)"
        if synthesizing
        else "the data loop has judged no candidate yet"
    )
    if summary.reward_first is None or summary.reward_last is None:
        trend = "no trained step yet, so no reward trend"
    elif summary.learner_steps < 2:
        trend = f"one trained step so far (reward {summary.reward_last:.3g}): no trend yet"
    else:
        change = summary.reward_last - summary.reward_first
        trend = f"reward moved {change:+.3f} from the first to the last trained step"
    return [f"- **Loop**: {loop}; {data}.", f"- **Learning**: {trend}."]


def render_run_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``report.md`` and its PNGs to ``out`` (default ``RUN_DIR/report``)."""
    out = out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    data = load_run(run_dir)
    summary = summarize_run(data)
    plot_learning(data, out / "learning.png")
    plot_signals(data, out / "signals.png")
    plot_pool(data, out / "pool.png")
    plot_verdicts(data, summary, out / "verdicts.png")
    plot_stages(summary, out / "stages.png")
    measured = read_measured(out / MEASURED_FILE)
    accepted = None
    if (run_dir / POOL_FILE).exists() and not data.pool_error:
        rows = accepted_rows(run_dir)
        write_accepted_rows(rows, out / ACCEPTED_FILE)
        accepted = accepted_summary(rows)
    write_exposure(data, out)
    (out / REPORT_FILE).write_text(run_markdown(data, summary, measured, accepted))
    return out / REPORT_FILE


def run_markdown(
    data: RunData,
    summary: RunSummary,
    measured: dict[str, Any] | None = None,
    accepted: dict[str, Any] | None = None,
) -> str:
    parts = [
        f"# Run report: `{data.run_dir.name if data.run_dir.name != 'run' else data.run_dir}`",
        "",
        *health_lines(summary),
        "",
        table(("", "value"), summary_rows(summary)),
        "",
        "Times are minutes since `coevolve up` started (or since the first event seen). "
        f"Rendered by `coevolve report {data.run_dir}`.",
    ]
    if data.pool_error:
        parts += ["", f"Pool file: {data.pool_error}."]
    parts += [
        "",
        "## Learning",
        "",
        "![learning](learning.png)",
        "",
        learning_text(data),
        "",
        "## Signals",
        "",
        "![signals](signals.png)",
        "",
        _signal_table(data),
        "",
        "## Pool growth",
        "",
        "![pool](pool.png)",
        "",
        "## Draws",
        "",
        draws_text(data),
        "",
        "## Exposure",
        "",
        exposure_text(exposure(data)),
        "",
        "## Verdicts",
        "",
        "![verdicts](verdicts.png)",
        "",
        _verdict_text(summary),
        *(["", _accepted_text(accepted)] if accepted is not None else []),
        "",
        "## Repair",
        "",
        repair_text(data, measured),
        "",
        *(
            ["## Experiences", "", experiences_text(data, summary.experiences_dropped), ""]
            if data.experiences or summary.experiences_dropped
            else []
        ),
        *(["## Step credit", "", step_credit_text(data), ""] if _labelled(data) else []),
        *(
            ["## Failure agent", "", hard_negatives_text(summary.hard_negatives), ""]
            if summary.hard_negatives is not None
            else []
        ),
        "## Time per stage",
        "",
        "![stages](stages.png)",
        "",
        _stage_table(summary),
        "",
        "## Log problems",
        "",
        _log_table(data),
        "",
    ]
    return "\n".join(parts)


def _labelled(data: RunData) -> list[StepGroup]:
    return [g for step in data.steps for g in step.groups if g.labelled or g.label_s]


def step_credit_text(data: RunData) -> str:
    """Self-attributing: the groups the attributor labelled before the learner trained on
    them, its labels, and its seconds per learner step."""
    groups = _labelled(data)
    good, bad = sum(g.good for g in groups), sum(g.bad for g in groups)
    seconds = sum(g.label_s for g in groups)
    steps = len(data.steps)
    per_step = f", {seconds / steps:.1f} s a learner step" if steps else ""
    share = f" ({good / (good + bad):.2f} GOOD)" if good + bad else ""
    return (
        f"The attributor labelled {sum(g.labelled for g in groups)} trajectories of "
        f"{len(groups)} trained groups: {good} steps GOOD, {bad} BAD{share}. "
        f"It took {seconds:.0f} s{per_step} (from `learner/steps.jsonl`)."
    )


def experiences_text(data: RunData, dropped: dict[str, int] | None = None) -> str:
    """Self-navigating: how many experiences the distiller drew, how often rollout jobs
    carried them, the most carried one, and the advice it did not keep, by reason."""
    rows = data.experiences
    text = f"The distiller kept no experience from rollout groups{dropped_text(dropped)}."
    if rows:
        carried = sum(row.retrieved for row in rows)
        jobs = len(data.groups)
        used = sum(1 for row in rows if row.retrieved)
        top = max(rows, key=lambda row: (row.retrieved, row.created_at))
        share = f" ({carried / jobs:.2f} a recorded group)" if jobs else ""
        text = (
            f"The distiller drew {len(rows)} experiences from rollout groups"
            f"{dropped_text(dropped)}; rollout jobs carried them {carried} times{share}, "
            f"{used} of them at least once (`coevolve experiences list`). The most carried "
            f"({top.retrieved} jobs, from task `{top.task_id}`, "
            f"minute {data.minutes(top.created_at):.1f}):\n\n> {top.text}"
        )
    return text


def dropped_text(dropped: dict[str, int] | None) -> str:
    """ ", and dropped 5 (incomplete 3, unknown_argument 2)": advice not kept, by reason."""
    if not dropped:
        return ""
    reasons = ", ".join(f"{reason} {count}" for reason, count in dropped.items())
    return f", and dropped {sum(dropped.values())} ({reasons})"


def learning_text(data: RunData) -> str:
    """The caption of the learning figure: where each panel's numbers come from."""
    measured = "Reward, KL and staleness are" if kl_computed(data) else "Reward and staleness are"
    text = (
        f"{measured} the learner's TensorBoard scalars at steps that trained; the "
        "uniform-group share is the fraction of groups whose rewards were all equal (no GRPO "
        "gradient)."
    )
    if not kl_computed(data) and data.learner_steps() > 0:
        text += f" {KL_NOT_COMPUTED}: no KL panel."
    if eval_tags(data):
        text += " " + _held_out_caption(data)
    return text


def _held_out_caption(data: RunData) -> str:
    drawn = held_out_lines(data)
    band = all(tag in data.scalars for tag in HELD_OUT_BAND)
    left = [t for t in eval_tags(data) if t not in drawn and not (band and t in HELD_OUT_BAND)]
    text = (
        "Held-out accuracy: the evaluator's scalars against the policy version evaluated ("
        + (", ".join(f"`{tag}`" for tag in drawn) or "none of them a share")
        + (f"; the band: `{HELD_OUT_BAND[0]}` to `{HELD_OUT_BAND[1]}`" if band and drawn else "")
        + ")."
    )
    if left:
        text += " Not drawn (not shares): " + ", ".join(f"`{tag}`" for tag in left) + "."
    return text


def _signal_table(data: RunData) -> str:
    emitted = data.signals_by_kind()
    if not emitted:
        return f"Signals: {NONE_YET}."
    received = Counter(kind for _, kind in data.signal_events())
    rows = [
        (kind, str(n), str(received.get(kind, 0)), str(data.signals_suppressed.get(kind, 0)))
        for kind, n in sorted(emitted.items())
    ]
    return table(("kind", "emitted", "received by the explorer", "suppressed"), rows)


def _verdict_text(summary: RunSummary) -> str:
    if not summary.candidates:
        return f"Verdicts: {NONE_YET}."
    head = (
        f"{summary.accepted} of {summary.candidates} candidates accepted "
        f"(acceptance rate {summary.acceptance_rate:.3f})."
    )
    if not summary.top_reasons:
        return head
    return (
        head
        + "\n\n"
        + table(("rejection reason", "count"), [(r, str(n)) for r, n in summary.top_reasons])
    )


def _accepted_text(accepted: dict[str, Any]) -> str:
    count = accepted["accepted_with_parent"]
    if not count:
        return "Accepted tasks with a parent: none."
    made = ", ".join(f"{n} {kind}" for kind, n in accepted["made_by"].items())
    return (
        f"Accepted tasks with a parent: {count}; {accepted['shares_failed_function']} of the "
        f"{accepted['failure_known']} whose parent's failure is recorded call a function the "
        f"policy got wrong there; {accepted['two_or_more_calls']} make two or more calls; "
        f"{accepted['same_functions_as_parent']} call just their parent turn's functions. "
        f"Made by: {made}. "
        f"Each beside its parent turn, with an empty label to fill in: [{ACCEPTED_FILE}]"
        f"({ACCEPTED_FILE})."
    )


def _stage_table(summary: RunSummary) -> str:
    if not summary.stage_seconds:
        return f"Stage times: {NONE_YET} (no trace spans)."
    rows = [(stage, f"{seconds:.1f}") for stage, seconds in summary.stage_seconds.items()]
    return table(("service: stage", "seconds (sum)"), rows)


def _log_table(data: RunData) -> str:
    rows = [
        (
            service,
            str(found.warnings),
            str(found.errors),
            str(found.tracebacks),
            plots.shorten(_after_level(found.first_error), 90),
        )
        for service, found in sorted(data.log_problems.items())
        if found.any
    ]
    if not rows:
        return "No warnings or errors in the service logs." if data.log_problems else "No logs."
    return table(("log", "warnings", "errors", "tracebacks", "first error"), rows)


def _after_level(line: str) -> str:
    """A log line without its time stamp and service name (from the level on)."""
    for level in (" ERROR ", " CRITICAL "):
        if level in line:
            return level.strip() + " " + line.split(level, 1)[1]
    return line


# ---------------------------------------------------------------------- draws and repair


def percent(share: float | None) -> str:
    return NONE_YET if share is None else f"{share:.1%}"


def _groups(n: float) -> str:
    count = f"{n:g}"
    return f"{count} group" if n == 1 else f"{count} groups"


def draws_text(data: RunData) -> str:
    rows = draw_rows(data)
    if not data.groups:
        return f"Draws: {NONE_YET} (no rollout group recorded)."
    recorded = rows[-1].trained is not None
    header = [
        "origin",
        "rollout groups",
        "tasks drawn / in pool",
        "largest task",
        "median task",
        "largest / median",
    ]
    if recorded:
        header += ["trained on (with gradient)", "dropped stale"]
    body = []
    for row in rows:
        cells = [
            f"**{row.origin}**" if row.origin == "all" else row.origin,
            str(row.groups),
            f"{row.tasks_drawn} / {row.tasks_in_pool}",
            f"`{row.largest_task}`: {_groups(row.largest_groups)} ({percent(row.largest_share)})"
            if row.largest_task is not None
            else "-",
            f"{_groups(row.median_groups)} ({percent(row.median_share)})" if row.groups else "-",
            f"{row.ratio:.3g}x" if row.ratio is not None else "-",
        ]
        if recorded:
            cells += [f"{row.trained} ({row.trained_with_gradient})", str(row.stale)]
        body.append(cells)
    note = (
        "Rollout groups per origin of their task (pool-store's `rollout_results`). The "
        "largest task is the most-drawn one; the median is over the tasks drawn at least "
        "once; shares are of the row's groups."
    )
    if recorded:
        note += (
            " Trained on: the groups of learner steps that updated the weights "
            "(`learner/steps.jsonl`), in brackets those whose rewards differed (a GRPO "
            "gradient); dropped stale: beyond the learner's staleness bound."
        )
    else:
        note += " No `learner/steps.jsonl`: what the learner trained on is not recorded."
    return table(header, body) + "\n\n" + note


def _scores(scores: Scores | None) -> str:
    if scores is None:
        return "-"
    return f"v{scores.version}: {scores.mean:.3g} ({scores.solved}/{scores.samples} solved)"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3g}"


def _pooled(samples: int, mean: float | None, solved: float | None) -> str:
    if mean is None or solved is None:
        return "-"
    return f"{samples}, {mean:.3g}, {solved:.3g}"


def repair_text(data: RunData, measured: dict[str, Any] | None) -> str:
    children = child_rows(data)
    if not children:
        parts = [f"Repair: {NONE_YET} (no accepted task names a parent)."]
    else:
        parts = [_parents_table(data), "", _children_table(children)]
    parts += ["", _measured_text(measured)]
    return "\n".join(parts)


def _parents_table(data: RunData) -> str:
    groups, source = parent_groups(data)
    rows = []
    for group in groups:
        paired = len(group.paired)
        rows.append(
            (
                group.label,
                f"{group.tasks} ({paired})",
                _pooled(*group.pooled("before")),
                _pooled(*group.pooled("after")),
                _signed(group.mean_change),
            )
        )
    head = (
        "Does training on a child raise its parent? From the rollouts: each parent's "
        "samples at the earliest policy version it was rolled out at (before) and at the "
        "latest (after), pooled over the tasks rolled out at two versions (paired); the "
        "change is the mean over those tasks of after minus before in mean score. Which "
        f"tasks raised a signal: {source.source}."
    )
    return (
        head
        + "\n\n"
        + table(
            (
                "group",
                "tasks (paired)",
                "before: samples, mean score, solved share",
                "after: samples, mean score, solved share",
                "mean change per task",
            ),
            rows,
        )
    )


def _children_table(children: list[ChildRow]) -> str:
    recorded = children[0].trained is not None
    rows = []
    for child in children[:CHILD_ROWS]:
        change = child.parent_change
        rows.append(
            (
                f"`{child.child}`",
                f"`{child.parent}`",
                child.kind,
                str(child.depth),
                str(child.child_groups),
                f"{child.trained} ({child.trained_with_gradient})" if recorded else "-",
                _scores(change.before if change else None),
                _scores(change.after if change else None),
                _signed(change.change if change else None),
            )
        )
    text = "Accepted tasks with a parent in their lineage:\n\n" + table(
        (
            "child",
            "parent",
            "signal kind",
            "depth",
            "child groups rolled out",
            "child groups trained on (with gradient)",
            "parent before",
            "parent after",
            "parent change",
        ),
        rows,
    )
    if len(children) > CHILD_ROWS:
        text += f"\n\n... and {len(children) - CHILD_ROWS} more."
    if not recorded:
        text += "\n\nNo `learner/steps.jsonl`: which tasks were trained on is not recorded."
    return text


def _change(change: dict[str, Any] | None) -> str:
    if not change:
        return "-"
    return (
        f"{change['mean']:+.3f} [{change['low']:+.3f}, {change['high']:+.3f}] p={change['p']:.2g}"
    )


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _measured_text(measured: dict[str, Any] | None) -> str:
    if measured is None:
        return (
            "Measured: not run (`coevolve report RUN_DIR --repair-samples N` plays each "
            "parent and as many no-signal seed tasks N times with policy v1 and with the "
            "last policy)."
        )
    first, last = measured["first_version"], measured["last_version"]
    rows = [
        (
            row["label"],
            str(row["tasks"]),
            f"{row['samples_first']} / {row['samples_last']}",
            f"{_share(row['success_first'])} -> {_share(row['success_last'])}",
            _change(row["success_change"]),
            f"{_share(row['partial_credit_first'])} -> {_share(row['partial_credit_last'])}",
            _change(row["partial_credit_change"]),
        )
        for row in measured["rows"]
    ]
    head = (
        f"Measured: each task played {measured['samples_per_task']} times by policy "
        f"v{first} and by v{last}, sampled like rollout"
        + (f" (engine {measured['engine']})" if measured.get("engine") else "")
        + ". Success is BFCL's; partial credit is the share of ground-truth calls matched "
        "(1 when solved). The change is per task (v"
        f"{last} minus v{first}), with a 95% bootstrap interval over tasks and a paired "
        "permutation p-value."
    )
    text = (
        head
        + "\n\n"
        + table(
            (
                "group",
                "tasks",
                f"samples v{first} / v{last}",
                f"success v{first} -> v{last}",
                "success change",
                f"partial credit v{first} -> v{last}",
                "partial credit change",
            ),
            rows,
        )
    )
    control = next((r for r in measured["rows"] if r["label"] == NO_SIGNAL), None)
    control_change = (control or {}).get("success_change")
    lines = [
        f"- {row['label']}: success change {row['success_change']['mean']:+.3f} against "
        f"{control_change['mean']:+.3f} for the no-signal tasks "
        f"(difference {row['success_change']['mean'] - control_change['mean']:+.3f})"
        for row in measured["rows"]
        if row["label"] != NO_SIGNAL and row["success_change"] and control_change
    ]
    return text + ("\n\n" + "\n".join(lines) if lines else "")
