"""``coevolve experiment report RESULTS``: whatever arm x seed results exist, as Markdown + PNGs.

It reads the results directory alone (what is committed), so it runs on a fresh clone.
Results made from another warm start than the one in ``warm-start.json`` are not pooled:
the report names them and leaves them out.

Per arm and mark (every ``--eval-every`` minute, and the arm's end): each held-out
measure's mean across seeds with a 95% t interval. Paired differences (coevolve -
random, random - none, coevolve - none, each mechanism or objective arm - coevolve) per
measure and mark take the held-out turn as the unit: each turn's difference is averaged
over the seeds that played it first, then the mean over turns gets a bootstrap interval
and a p-value (exact sign test for success, sign-flip permutation otherwise). Each
seed's own mean difference stands beside it, with a t interval over seeds from three
seeds on (with fewer, the report claims none).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevolve.experiment import ARMS, MECHANISM_ARMS, OBJECTIVE_ARMS
from coevolve.experiment.ablation import END_MARK, WARM_EVAL_FILE, WARM_START_RECORD
from coevolve.report import plots
from coevolve.report.run_report import table
from coevolve.report.stats import (
    Interval,
    bootstrap_mean_interval,
    differences_p_value,
    mean_interval,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

REPORT_FILE = "report.md"
COMPARISONS = (
    ("coevolve", "random"),
    ("random", "none"),
    ("coevolve", "none"),
    *((arm, "coevolve") for arm in (*MECHANISM_ARMS, *OBJECTIVE_ARMS)),
    # no labels: what labelled turns at the same pace add, and how far coevolve is from it
    ("labelled_control", "none"),
    ("coevolve", "labelled_control"),
    # self-navigating with synthesis off in both
    ("navigate_on", "navigate_off"),
)
# the exposure figures of a result (RESULT["exposure"], as `coevolve status --json`)
EXPOSURE_SHARES = ("exposure_first_half", "exposure_second_half")
# the share of the control's gain a method reaches: (method - none) / (control - none)
CONTROL_SHARE = ("coevolve", "labelled_control", "none")
# (name, index in a task's [success, partial credit, log-likelihood] record)
MEASURES = (("success", 0), ("partial credit", 1), ("log-likelihood", 2))
WARM_MARK = "0"
RESULT_NAME = re.compile(r"[a-z_]+-s\d+\.json")
# the optional mechanisms' LLM roles, as RunSummary.role_llm_seconds names them
MECHANISM_ROLES = ("attributor", "distiller")
ARM_ORDER = {arm: index for index, arm in enumerate(ARMS)}
ARM_COLORS = {
    "none": "tab:grey",
    "random": "tab:orange",
    "coevolve": "tab:green",
    "labelled_control": "tab:blue",
}
SEED_STYLES = ("-", "--", ":", "-.")
# below this many seeds the report gives no interval over seeds
MIN_SEEDS_FOR_INTERVAL = 3


@dataclass(frozen=True)
class MarkScore:
    """One evaluated policy of one arm x seed: per task [success, partial, log-lik]."""

    arm: str
    seed: int
    mark: str
    minute: float
    policy_version: int
    tasks: dict[str, list[float | None]]

    def mean(self, measure: int) -> float | None:
        values = [value for v in self.tasks.values() if (value := v[measure]) is not None]
        return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Results:
    """The pooled arm x seed results, those left out for another warm start, and those
    of a step-ended experiment that ended by minutes first (``short``)."""

    kept: list[dict[str, Any]]
    excluded: list[dict[str, Any]]
    warm_start: dict[str, Any] | None
    warm_eval: dict[str, Any] | None
    short: list[dict[str, Any]] = field(default_factory=list)


def load_results(results_dir: Path) -> Results:
    """Every ``<arm>-s<seed>.json``; pooled are those of the recorded warm start (or, with
    no record, of the warm start most results share)."""
    found = []
    for path in sorted(results_dir.glob("*-s*.json")):
        if not RESULT_NAME.fullmatch(path.name):
            continue
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    found.sort(key=lambda r: (ARM_ORDER.get(r["arm"], 99), r["seed"]))
    record = _read(results_dir / WARM_START_RECORD)
    digests = Counter(r.get("warm_start_sha256") for r in found)
    if record is not None:
        wanted = record["sha256"]
    else:
        wanted = digests.most_common(1)[0][0] if digests else None
    kept = [r for r in found if r.get("warm_start_sha256") == wanted]
    excluded = [r for r in found if r.get("warm_start_sha256") != wanted]
    # arms compared at equal learner steps: one that stopped at its minutes cap short of
    # its steps would be compared at fewer updates
    short = [r for r in kept if r.get("steps") is not None and r.get("ended_by") != "steps"]
    kept = [r for r in kept if r not in short]
    warm_eval = _read(results_dir / WARM_EVAL_FILE)
    if warm_eval is not None and warm_eval.get("warm_start_sha256") != wanted:
        warm_eval = None
    return Results(kept, excluded, record, warm_eval, short)


def _read(path: Path) -> dict[str, Any] | None:
    return dict(json.loads(path.read_text())) if path.exists() else None


def mark_scores(results: list[dict[str, Any]], warm_eval: dict[str, Any] | None) -> list[MarkScore]:
    """Every evaluated mark; the shared warm start is mark 0 of every arm x seed."""
    scores: list[MarkScore] = []
    for result in results:
        arm, seed = result["arm"], int(result["seed"])
        if warm_eval is not None:
            scores.append(MarkScore(arm, seed, WARM_MARK, 0.0, 1, warm_eval["tasks"]))
        for mark in result.get("marks", []):
            if mark.get("eval"):
                scores.append(
                    MarkScore(
                        arm,
                        seed,
                        str(mark["mark"]),
                        float(mark["minute"]),
                        int(mark["policy_version"]),
                        mark["eval"]["tasks"],
                    )
                )
    return scores


def mark_order(mark: str) -> float:
    return float("inf") if mark == END_MARK else float(mark)


def measure_intervals(scores: list[MarkScore], measure: int) -> dict[str, dict[str, Interval]]:
    """arm -> mark -> the measure's mean across seeds with its 95% t interval."""
    grouped: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for score in scores:
        value = score.mean(measure)
        if value is not None:
            grouped[score.arm][score.mark].append(value)
    return {
        arm: {mark: mean_interval(by_mark[mark]) for mark in sorted(by_mark, key=mark_order)}
        for arm, by_mark in grouped.items()
    }


def seed_turn_differences(
    scores: list[MarkScore], first: str, second: str, mark: str, measure: int
) -> dict[int, dict[str, float]]:
    """seed -> held-out turn -> ``first - second`` on each turn both arms of the seed
    scored at ``mark``."""
    by_key = {(s.arm, s.seed, s.mark): s for s in scores}
    by_seed: dict[int, dict[str, float]] = {}
    for seed in sorted({s.seed for s in scores}):
        a, b = by_key.get((first, seed, mark)), by_key.get((second, seed, mark))
        if a is None or b is None:
            continue
        # sorted: a set's order follows the string hash, which differs between processes
        differences = {
            turn: x - y
            for turn in sorted(a.tasks.keys() & b.tasks)
            if (x := a.tasks[turn][measure]) is not None
            and (y := b.tasks[turn][measure]) is not None
        }
        if differences:
            by_seed[seed] = differences
    return by_seed


def turn_differences(
    scores: list[MarkScore], first: str, second: str, mark: str, measure: int
) -> dict[str, float]:
    """held-out turn -> ``first - second`` averaged over the seeds that scored it, in
    turn order: a turn counts once however many seeds played it."""
    per_turn: dict[str, list[float]] = defaultdict(list)
    for differences in seed_turn_differences(scores, first, second, mark, measure).values():
        for turn, difference in differences.items():
            per_turn[turn].append(difference)
    return {turn: sum(values) / len(values) for turn, values in sorted(per_turn.items())}


def _compared_marks(scores: list[MarkScore]) -> list[str]:
    return sorted({s.mark for s in scores if s.mark != WARM_MARK}, key=mark_order)


def paired_intervals(
    scores: list[MarkScore], first: str, second: str, measure: int = 0
) -> dict[str, Interval]:
    """mark -> mean of ``first - second`` over the held-out turns (each averaged over its
    seeds first), with a 95% bootstrap interval over turns. Mark 0 (the shared warm
    start) is left out."""
    intervals: dict[str, Interval] = {}
    for mark in _compared_marks(scores):
        differences = turn_differences(scores, first, second, mark, measure)
        if differences:
            intervals[mark] = bootstrap_mean_interval(list(differences.values()))
    return intervals


def paired_p_values(
    scores: list[MarkScore], first: str, second: str, measure: int = 0
) -> dict[str, float]:
    """mark -> two-sided p-value of ``first - second`` with the held-out turn as the unit,
    each turn's difference averaged over its seeds first: the exact sign test for success,
    the sign-flip permutation test otherwise."""
    p_values: dict[str, float] = {}
    for mark in _compared_marks(scores):
        differences = turn_differences(scores, first, second, mark, measure)
        if differences:
            p_values[mark] = differences_p_value(list(differences.values()), binary=measure == 0)
    return p_values


def seed_differences(
    scores: list[MarkScore], first: str, second: str, measure: int = 0
) -> dict[str, dict[int, float]]:
    """mark -> seed -> that seed's own mean ``first - second`` over its held-out turns."""
    return {
        mark: {
            seed: sum(differences.values()) / len(differences)
            for seed, differences in by_seed.items()
        }
        for mark in _compared_marks(scores)
        if (by_seed := seed_turn_differences(scores, first, second, mark, measure))
    }


@dataclass(frozen=True)
class PairedDifference:
    """``first - second`` at one mark: over turns (interval and p), and per seed."""

    turns: Interval
    p: float
    per_seed: dict[int, float]

    @property
    def over_seeds(self) -> Interval | None:
        """The 95% t interval over the seeds' own differences; none with too few seeds."""
        values = list(self.per_seed.values())
        return mean_interval(values) if len(values) >= MIN_SEEDS_FOR_INTERVAL else None


def paired_differences(
    scores: list[MarkScore], first: str, second: str, measure: int = 0
) -> dict[str, PairedDifference]:
    """mark -> the paired difference ``first - second`` (the warm start's mark left out)."""
    intervals = paired_intervals(scores, first, second, measure)
    p_values = paired_p_values(scores, first, second, measure)
    per_seed = seed_differences(scores, first, second, measure)
    return {
        mark: PairedDifference(interval, p_values[mark], per_seed[mark])
        for mark, interval in intervals.items()
    }


def end_minutes(scores: list[MarkScore]) -> dict[str, float]:
    """arm -> the mean minute its seeds ended at (where the end mark is drawn)."""
    ends: dict[str, list[float]] = defaultdict(list)
    for score in scores:
        if score.mark == END_MARK:
            ends[score.arm].append(score.minute)
    return {arm: sum(values) / len(values) for arm, values in ends.items()}


# ---------------------------------------------------------------------- plots


def _at_minutes(points: dict[str, Interval], end_minute: float | None) -> dict[float, Interval]:
    placed = {float(m): i for m, i in points.items() if m != END_MARK}
    if END_MARK in points and end_minute is not None:
        placed[end_minute] = points[END_MARK]
    return dict(sorted(placed.items()))


def plot_measures(
    intervals: dict[str, dict[str, dict[str, Interval]]], ends: dict[str, float], path: Path
) -> Path:
    """One panel per measure: each arm's mean across seeds at its marks."""
    figure, axes = plots.panels(len(MEASURES), columns=len(MEASURES))
    figure.set_size_inches(5 * len(MEASURES), 4)
    for ax, (name, _) in zip(axes, MEASURES, strict=True):
        ax.set_title(f"held-out {name} (mean, 95% interval across seeds)", fontsize=9)
        by_arm = intervals.get(name, {})
        if not by_arm:
            plots.empty_note(ax)
            continue
        placed = {arm: _at_minutes(points, ends.get(arm)) for arm, points in by_arm.items()}
        for arm in sorted(placed, key=lambda a: ARM_ORDER.get(a, 99)):
            offset = 0.004 * _span(placed) * (ARM_ORDER.get(arm, 1) - 1)
            _interval_band(ax, arm, placed[arm], offset=offset, color=ARM_COLORS.get(arm))
        _minutes_axis(ax, placed)
        ax.set_xlabel("minutes since the warm start", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return plots.save(figure, path)


def plot_differences(
    differences: dict[str, dict[str, Interval]], ends: dict[str, float], path: Path
) -> Path:
    """Held-out success differences between arms at each mark."""
    figure, (ax,) = plots.panels(1, columns=1)
    ax.set_title("paired differences in held-out success (95% bootstrap over turns)", fontsize=10)
    end = max(ends.values(), default=None)
    drawn = {name: _at_minutes(p, end) for name, p in differences.items() if p}
    if not drawn:
        plots.empty_note(ax)
    for index, (name, points) in enumerate(drawn.items()):
        _interval_band(ax, name, points, offset=0.004 * _span(drawn) * index)
    if drawn:
        _minutes_axis(ax, drawn)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("minutes since the warm start", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return plots.save(figure, path)


def plot_data_loop(results: list[dict[str, Any]], path: Path) -> Path:
    figure, (growth, signals) = plots.panels(2)
    growth.set_title("tasks added to the pool (cumulative)", fontsize=10)
    if not results:
        plots.empty_note(growth)
    for result in results:
        end = result.get("end_minute") or result.get("minutes")
        xs, ys = plots.cumulative(result.get("added_minutes", []), end=end)
        growth.step(
            xs,
            ys,
            where="post",
            color=ARM_COLORS.get(result["arm"]),
            linestyle=SEED_STYLES[result["seed"] % len(SEED_STYLES)],
            label=f"{result['arm']} s{result['seed']}",
        )
    if results:
        growth.set_xlabel("minutes since start", fontsize=9)
        growth.set_ylabel("tasks", fontsize=9)
        plots.count_axis(growth)
        growth.grid(alpha=0.3)
        growth.legend(fontsize=7)
    kinds: dict[str, float] = defaultdict(float)
    for result in results:
        for kind, count in result["summary"]["signals_by_kind"].items():
            kinds[f"{result['arm']}: {kind}"] += count / _seeds(results, result["arm"])
    plots.bars(signals, kinds, title="signals by kind (mean per seed)")
    return plots.save(figure, path)


def plot_cpu(results: list[dict[str, Any]], path: Path) -> Path:
    """CPU minutes per part of the run (mean per seed), per arm."""
    figure, (ax,) = plots.panels(1, columns=1)
    figure.set_size_inches(9, 4.5)
    values: dict[str, float] = {}
    for result in results:
        arm = result["arm"]
        for part, seconds in result.get("cpu_seconds", {}).items():
            key = f"{arm}: {part}"
            values[key] = values.get(key, 0.0) + seconds / 60.0 / _seeds(results, arm)
    plots.bars(
        ax, values, title="CPU minutes per part of the run (mean per seed)", xlabel="minutes"
    )
    return plots.save(figure, path)


def _span(series: dict[str, dict[float, Interval]]) -> float:
    """The width of the x axis (minutes), at least 1."""
    minutes = [m for points in series.values() for m in points]
    return max(1.0, max(minutes, default=0.0) - min(minutes, default=0.0))


def _interval_band(
    ax: Axes,
    name: str,
    points: dict[float, Interval],
    *,
    offset: float,
    color: str | None = None,
) -> None:
    """``points`` (minute -> interval) as one band."""
    xs = list(points)
    low = [points[x].low for x in xs]
    high = [points[x].high for x in xs]
    plots.band(ax, name, xs, [points[x].mean for x in xs], low, high, color=color, offset=offset)


def _minutes_axis(ax: Axes, series: dict[str, dict[float, Interval]]) -> None:
    """From minute 0 to the last mark, with a margin (one mark alone is not zoomed into)."""
    span = _span(series)
    last = max((m for points in series.values() for m in points), default=0.0)
    ax.set_xlim(-0.05 * span, last + 0.1 * span)


def _seeds(results: list[dict[str, Any]], arm: str) -> int:
    return max(1, sum(1 for r in results if r["arm"] == arm))


# ---------------------------------------------------------------------- markdown


def _interval_text(interval: Interval, digits: int = 3) -> str:
    return (
        f"{interval.mean:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}] "
        f"(n={interval.n})"
    )


def _p_text(p: float | None) -> str:
    if p is None:
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _mean_text(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    interval = mean_interval(values)
    if interval.n == 1:
        return f"{interval.mean:.{digits}f}"
    return f"{interval.mean:.{digits}f} ± {(interval.high - interval.low) / 2:.{digits}f}"


def _seeds_mean_text(values: list[float], digits: int = 1) -> str:
    """Like ``_mean_text``, but the interval only with enough seeds to estimate one."""
    if len(values) < MIN_SEEDS_FOR_INTERVAL:
        return f"{sum(values) / len(values):.{digits}f}" if values else "-"
    return _mean_text(values, digits)


def _per_seed_text(by_seed: dict[int, float], digits: int = 3) -> str:
    return ", ".join(f"s{seed} {value:+.{digits}f}" for seed, value in sorted(by_seed.items()))


def _over_seeds_text(values: list[float], digits: int = 3) -> str:
    """The 95% t interval over the seeds' own values, or why there is none."""
    if len(values) < MIN_SEEDS_FOR_INTERVAL:
        return f"n/a (fewer than {MIN_SEEDS_FOR_INTERVAL} seeds)"
    return _interval_text(mean_interval(values), digits)


def _by_arm(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    arms: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        arms[result["arm"]].append(result)
    return dict(sorted(arms.items(), key=lambda kv: ARM_ORDER.get(kv[0], 99)))


def pool_growth(summary: dict[str, Any]) -> int:
    """The tasks a run added: ``tasks_added``, or in a result written before it was
    recorded every task not of the seed origin (a no-label run's D0 included)."""
    if summary.get("tasks_added") is not None:
        return int(summary["tasks_added"])
    return sum(n for origin, n in summary["pool_by_origin"].items() if origin != "seed")


def data_loop_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for arm, mine in _by_arm(results).items():
        summaries = [r["summary"] for r in mine]
        candidates = sum(s["candidates"] for s in summaries)
        accepted = sum(s["accepted"] for s in summaries)
        growth = [float(pool_growth(s)) for s in summaries]
        rows.append(
            [
                arm,
                str(len(mine)),
                _mean_text([sum(s["signals_by_kind"].values()) for s in summaries]),
                _mean_text([s["candidates"] for s in summaries]),
                _mean_text([s["accepted"] for s in summaries]),
                f"{accepted / candidates:.3f}" if candidates else "none yet",
                _mean_text(growth),
                *(_exposure_text(mine, key, 2) for key in EXPOSURE_SHARES),
                _exposure_text(mine, "median_versions_to_first_draw", 1),
            ]
        )
    return rows


def _exposure_text(results: list[dict[str, Any]], key: str, digits: int) -> str:
    """The mean over seeds of one exposure figure (``-``: none recorded)."""
    values = [
        float(value)
        for result in results
        if (value := (result.get("exposure") or {}).get(key)) is not None
    ]
    return _mean_text(values, digits)


def compute_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """Per arm: how long it ran, what it did and the CPU it used (means per seed)."""
    rows = []
    for arm, mine in _by_arm(results).items():
        cpu = [r.get("cpu_seconds", {}) for r in mine]
        policy_parts = ("rollout", "learner")
        rows.append(
            [
                arm,
                str(len(mine)),
                _mean_text([r.get("end_minute") or r["minutes"] for r in mine]),
                ", ".join(sorted({str(r.get("ended_by", "minutes")) for r in mine})),
                _mean_text([r["summary"]["learner_steps"] for r in mine]),
                _mean_text([r["summary"]["groups_recorded"] for r in mine]),
                _mean_text([sum(c.get(p, 0.0) for p in policy_parts) / 60 for c in cpu]),
                _mean_text([c.get("llm", 0.0) / 60 for c in cpu]),
                _mean_text([sum(c.values()) / 60 for c in cpu]),
            ]
        )
    return rows


def mechanism_roles(results: list[dict[str, Any]]) -> list[str]:
    """The mechanisms' LLM roles that spent time in any of ``results``."""
    spent = [r["summary"].get("role_llm_seconds", {}) for r in results]
    return [role for role in MECHANISM_ROLES if any(s.get(role) for s in spent)]


def mechanism_rows(results: list[dict[str, Any]], roles: Sequence[str]) -> list[list[str]]:
    """Per arm: the uniform-group share, the role-LLM seconds per learner step of
    ``roles``, and the experiences drawn when the distiller is among them (means per
    seed; results older than these fields read 0 seconds and 0 experiences)."""
    rows = []
    for arm, mine in _by_arm(results).items():
        summaries = [r["summary"] for r in mine]
        steps = [max(s["learner_steps"], 1) for s in summaries]
        seconds = [s.get("role_llm_seconds", {}) for s in summaries]
        uniform = [s["uniform_share"] for s in summaries if s.get("uniform_share") is not None]
        per_step = [
            _mean_text([sec.get(role, 0.0) / n for sec, n in zip(seconds, steps, strict=True)])
            for role in roles
        ]
        drawn = [float(s.get("experiences", 0)) for s in summaries]
        experiences = [_mean_text(drawn), _dropped_text(summaries)] if "distiller" in roles else []
        rows.append([arm, str(len(mine)), _mean_text(uniform, 3), *per_step, *experiences])
    return rows


def _dropped_text(summaries: list[dict[str, Any]]) -> str:
    """The advice the distiller did not keep, over all seeds: the total, then by reason."""
    dropped: Counter[str] = Counter()
    for summary in summaries:
        dropped.update(summary.get("experiences_dropped") or {})
    if not dropped:
        return "0"
    reasons = ", ".join(f"{reason} {count}" for reason, count in dropped.most_common())
    return f"{dropped.total()} ({reasons})"


def gain_rows(scores: list[MarkScore], results: list[dict[str, Any]]) -> list[list[str]]:
    """Per arm and measure: end - v1, each seed's own, and per wall minute and per
    learner step (means over seeds of each seed's own ratio)."""
    ends = {(s.arm, s.seed): s for s in scores if s.mark == END_MARK}
    warm = {(s.arm, s.seed): s for s in scores if s.mark == WARM_MARK}
    rows = []
    for arm, mine in _by_arm(results).items():
        for name, measure in MEASURES:
            per_minute, per_step, total = [], [], {}
            for result in mine:
                key = (arm, int(result["seed"]))
                if key not in ends or key not in warm:
                    continue
                end, start = ends[key].mean(measure), warm[key].mean(measure)
                if end is None or start is None:
                    continue
                total[key[1]] = end - start
                per_minute.append((end - start) / max(ends[key].minute, 1e-9))
                steps = result["summary"]["learner_steps"]
                if steps:
                    per_step.append((end - start) / steps)
            if total:
                rows.append(
                    [
                        arm,
                        name,
                        f"{sum(total.values()) / len(total):.3f}",
                        _per_seed_text(total),
                        _over_seeds_text(list(total.values())),
                        _seeds_mean_text([1000 * g for g in per_minute], 2),
                        _seeds_mean_text([1000 * g for g in per_step], 2),
                    ]
                )
    return rows


def render_experiment_report(results_dir: Path, report_dir: Path | None = None) -> Path:
    """Aggregate every result under ``results_dir`` into ``report.md`` + PNGs."""
    report_dir = report_dir or results_dir / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    found = load_results(results_dir)
    scores = mark_scores(found.kept, found.warm_eval)
    ends = end_minutes(scores)
    intervals = {name: measure_intervals(scores, index) for name, index in MEASURES}
    ran = {score.arm for score in scores}
    compared = [(a, b) for a, b in COMPARISONS if a in ran and b in ran]
    differences = {
        name: {f"{a} - {b}": paired_differences(scores, a, b, index) for a, b in compared}
        for name, index in MEASURES
    }
    success = {
        name: {mark: d.turns for mark, d in points.items()}
        for name, points in differences["success"].items()
    }
    plot_measures(intervals, ends, report_dir / "heldout.png")
    plot_differences(success, ends, report_dir / "differences.png")
    plot_data_loop(found.kept, report_dir / "data_loop.png")
    plot_cpu(found.kept, report_dir / "cpu.png")
    spec = _read(results_dir / "experiment.json") or {}
    sections = [
        _header_section(found, spec),
        _heldout_section(intervals),
        _differences_section(differences),
        _compute_section(found.kept),
        _mechanisms_section(found.kept),
        _gains_section(scores, found.kept),
        _data_loop_section(found.kept),
    ]
    text = "\n".join(line for section in sections for line in section) + "\n"
    (report_dir / REPORT_FILE).write_text(text)
    return report_dir / REPORT_FILE


def machine_line(result: dict[str, Any]) -> str | None:
    """The CPU and dtype a result was measured with: its ``cpu`` and ``dtype``, or the
    ``machine`` of a result written before those (None: neither recorded)."""
    cpu, dtype = result.get("cpu"), result.get("dtype")
    if isinstance(cpu, dict):
        model = cpu.get("model")
    elif isinstance(machine := result.get("machine"), dict):
        cpu, model, dtype = machine, machine.get("cpu"), machine.get("dtype")
    else:
        return None
    return (
        f"{model} ({cpu.get('cores')} cores, avx512_bf16 {cpu.get('avx512_bf16')}, "
        f"amx_bf16 {cpu.get('amx_bf16')}, {dtype})"
    )


def _header_section(found: Results, spec: dict[str, Any]) -> list[str]:
    """The title, the spec, the warm start, what finished, on which code and machines."""
    results = found.kept
    done = ", ".join(f"{r['arm']} s{r['seed']}" for r in results) or "none yet"
    versions = sorted({str(r.get("code_version")) for r in results})
    machines = sorted({line for r in results if (line := machine_line(r))})
    warm = found.warm_start
    arms = spec.get("arms") or sorted(
        {r["arm"] for r in results}, key=lambda arm: ARM_ORDER.get(arm, 99)
    )
    parts = [
        f"# Experiment: {' vs '.join(arms) or 'no arm yet'}",
        "",
        f"Spec: {json.dumps(spec, sort_keys=True) if spec else 'unknown'}.",
        "",
        f"Warm start: sha256 `{warm['sha256']}`." if warm else "Warm start: not recorded.",
        f"Finished arm x seed: {done}.",
        f"Code: {', '.join(versions) or 'none yet'}"
        + (" (**arms ran on different code**)" if len(versions) > 1 else "."),
        f"Machines: {'; '.join(machines) or 'not recorded'}.",
    ]
    if found.excluded:
        names = ", ".join(f"{r['arm']} s{r['seed']}" for r in found.excluded)
        parts.append(
            f"**Not pooled: {names}** started from another warm start "
            "(their `warm_start_sha256` differs), so they are left out of every figure."
        )
    if found.short:
        names = ", ".join(f"{r['arm']} s{r['seed']}" for r in found.short)
        parts.append(
            f"**Not pooled: {names}** reached the minutes cap before its learner steps "
            "(`ended_by` minutes), so they are left out of every figure."
        )
    return parts


def _heldout_section(intervals: dict[str, dict[str, dict[str, Interval]]]) -> list[str]:
    """Each measure per arm and mark: the mean across seeds with its t interval."""
    parts = ["", "## Held-out measures", "", "![held-out](heldout.png)", ""]
    if not any(intervals.values()):
        return [*parts, "Held-out measures: none yet."]
    for name, by_arm in intervals.items():
        marks = sorted({m for points in by_arm.values() for m in points}, key=mark_order)
        arms = sorted(by_arm, key=lambda a: ARM_ORDER.get(a, 99))
        rows = [
            [m] + [_interval_text(by_arm[a][m]) if m in by_arm[a] else "-" for a in arms]
            for m in marks
        ]
        parts += [f"**{name}**: mean across seeds [95% t interval] (seeds).", ""]
        parts += [table(["mark (minute)", *arms], rows), ""]
    parts.append(
        "Mark 0 is the shared warm start; `end` is where each arm stopped (its minutes, "
        "or its learner steps)."
    )
    return parts


def _differences_section(
    differences: dict[str, dict[str, dict[str, PairedDifference]]],
) -> list[str]:
    """The paired differences between arms: over turns, then each seed's own."""
    parts = ["", "## Paired differences", "", "![differences](differences.png)", ""]
    rows = [
        [
            comparison,
            name,
            mark,
            _interval_text(d.turns),
            _excludes_zero_text(d),
            _p_text(d.p),
            _per_seed_text(d.per_seed),
            _over_seeds_text(list(d.per_seed.values())),
        ]
        for name, by_comparison in differences.items()
        for comparison, points in by_comparison.items()
        for mark, d in points.items()
    ]
    if not rows:
        return [*parts, "Paired differences: none yet (need two arms of the same seed)."]
    return [
        *parts,
        "The unit is the held-out turn: each turn's difference (the two arms of a seed on "
        "that turn) is first averaged over the seeds that played it, so a turn counts once "
        "however many seeds ran. Over those turn differences: the mean with a 95% bootstrap "
        "interval (n = turns), and the two-sided p (exact sign test on success, turns above "
        "0 against turns below, ties dropped; a sign-flip permutation test otherwise). "
        "These carry the turn sampling, not the seed-to-seed variation: that shows in each "
        "seed's own mean difference beside them, and in a 95% t interval over those, given "
        f"with {MIN_SEEDS_FOR_INTERVAL} seeds or more.",
        "",
        table(
            [
                "difference",
                "measure",
                "mark",
                "mean [95% interval, turns]",
                "excludes 0: turns, seeds",
                "p, turns",
                "per seed",
                "over seeds [95% t]",
            ],
            rows,
        ),
        *_control_share_lines(differences),
    ]


def control_share(
    differences: dict[str, dict[str, PairedDifference]],
) -> tuple[float, float, float, list[int]] | None:
    """At the end mark of one measure: (method - none, control - none, their ratio, the
    seeds), each difference the mean of its seeds' own differences over the seeds where
    all three arms ran; None without such a seed or where the control gained nothing."""
    method, control, base = CONTROL_SHARE
    gained = differences.get(f"{method} - {base}", {}).get(END_MARK)
    best = differences.get(f"{control} - {base}", {}).get(END_MARK)
    if gained is None or best is None:
        return None
    # on different seeds the two differences would mix seed-to-seed variation into the ratio
    seeds = sorted(gained.per_seed.keys() & best.per_seed.keys())
    if not seeds:
        return None
    method_gain = sum(gained.per_seed[seed] for seed in seeds) / len(seeds)
    control_gain = sum(best.per_seed[seed] for seed in seeds) / len(seeds)
    if control_gain <= 0:
        return None
    return method_gain, control_gain, method_gain / control_gain, seeds


def _control_share_lines(
    differences: dict[str, dict[str, dict[str, PairedDifference]]],
) -> list[str]:
    """One line per measure: the share of the control's gain over none that the method
    reaches at the end mark, on the seeds where all three arms ran."""
    method, control, base = CONTROL_SHARE
    lines = []
    for name, by_comparison in differences.items():
        if f"{control} - {base}" not in by_comparison:
            continue
        share = control_share(by_comparison)
        text = (
            f"{share[2]:.2f} ({share[0]:+.3f} of {share[1]:+.3f}; "
            f"seeds {', '.join(f's{seed}' for seed in share[3])})"
            if share
            else f"none (no seed on which {method}, {control} and {base} all ran, or "
            f"{control} did not gain there)"
        )
        lines.append(
            f"- Share of the control's gain in {name}, ({method} - {base}) / "
            f"({control} - {base}) at the end: {text}."
        )
    return ["", *lines] if lines else []


def _excludes_zero_text(difference: PairedDifference) -> str:
    """Whether the interval over turns, and the one over seeds, exclude 0."""
    over_seeds = difference.over_seeds
    seeds = "n/a" if over_seeds is None else "yes" if over_seeds.excludes_zero else "no"
    return f"{'yes' if difference.turns.excludes_zero else 'no'}, {seeds}"


def _figure_section(
    title: str,
    figure: str,
    results: list[dict[str, Any]],
    header: list[str],
    rows: Callable[[list[dict[str, Any]]], list[list[str]]],
    note: str = "",
) -> list[str]:
    """A section of its figure, then (where there are results) its table and ``note``."""
    parts = ["", f"## {title}", "", figure, ""]
    if not results:
        return parts
    return [*parts, table(header, rows(results)), *(["", note] if note else [])]


def _compute_section(results: list[dict[str, Any]]) -> list[str]:
    """Per arm: minutes, what ended it, steps, groups and CPU minutes."""
    header = [
        "arm",
        "seeds",
        "minutes",
        "ended by",
        "learner steps",
        "rollout groups",
        "CPU min, rollout + learner",
        "CPU min, LLM server",
        "CPU min, all",
    ]
    note = "Means per seed, ± the half-width of the 95% t interval across seeds."
    return _figure_section(
        "Compute per arm", "![cpu](cpu.png)", results, header, compute_rows, note
    )


def _mechanisms_section(results: list[dict[str, Any]]) -> list[str]:
    """Per arm: uniform groups and the mechanisms' LLM time per learner step."""
    if not results:
        return []
    roles = mechanism_roles(results)
    header = [
        "arm",
        "seeds",
        "uniform-group share",
        *(f"{role} LLM s per step" for role in roles),
        *(["experiences drawn", "dropped, all seeds (why)"] if "distiller" in roles else []),
    ]
    return [
        "",
        "## Groups and mechanisms per arm",
        "",
        table(header, mechanism_rows(results, roles)),
        "",
        "Uniform groups: every trajectory scored the same, so GRPO has no gradient."
        + (
            " Role-LLM seconds per learner step: the attributor labelling steps (step "
            "credit), the distiller drawing experiences (self-navigating); it drops advice "
            "that is incomplete or names a function or argument the environment lacks."
            if roles
            else ""
        ),
    ]


def _gains_section(scores: list[MarkScore], results: list[dict[str, Any]]) -> list[str]:
    """Per arm and measure: end minus the warm start, per minute and per learner step."""
    gains = gain_rows(scores, results)
    if not gains:
        return []
    header = [
        "arm",
        "measure",
        "end - v1",
        "per seed",
        "over seeds [95% t]",
        "per minute x1000",
        "per step x1000",
    ]
    return [
        "",
        "## Gain per wall minute and per learner step",
        "",
        "End minus the warm start, per seed (its mean over the held-out turns), then divided "
        "by the seed's minutes or learner steps (x 1000); means across seeds, ± the "
        "half-width of the 95% t interval across seeds where there are "
        f"{MIN_SEEDS_FOR_INTERVAL} or more.",
        "",
        table(header, gains),
    ]


def _data_loop_section(results: list[dict[str, Any]]) -> list[str]:
    """Per arm: signals, candidates, accepted tasks and the pool's growth."""
    header = ["arm", "seeds", "signals", "candidates", "accepted", "acceptance rate", "pool growth"]
    header += ["exposure, 1st half", "exposure, 2nd half", "versions to first draw (median)"]
    figure = "![data loop](data_loop.png)"
    note = (
        "Exposure: the share of the trained groups with a gradient that are on synthesized "
        "tasks (labelled_control: on the labelled turns it added), in each half of the "
        "learner steps; versions to first draw: from a child's signal to its first rollout "
        "(`coevolve report`, docs/data-loop.md)."
    )
    return _figure_section("Data loop per arm", figure, results, header, data_loop_rows, note)
