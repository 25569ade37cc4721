"""``coevolve experiment report DIR``: whatever arm x seed results exist, as Markdown + PNGs.

Held-out success per arm and minute mark: the mean across seeds with a 95% t interval.
Paired differences (coevolve - random, random - none) at each mark: per seed, the
difference on each held-out task both arms played, with a two-level bootstrap interval
(seeds, then tasks). An interval that excludes 0 is called significant; nothing else is.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevolve.experiment import ARMS
from coevolve.report import plots
from coevolve.report.run_report import table
from coevolve.report.stats import Interval, mean_interval, paired_bootstrap_interval

if TYPE_CHECKING:
    from matplotlib.axes import Axes

REPORT_FILE = "report.md"
COMPARISONS = (("coevolve", "random"), ("random", "none"))
ARM_ORDER = {arm: index for index, arm in enumerate(ARMS)}
ARM_COLORS = {"none": "tab:grey", "random": "tab:orange", "coevolve": "tab:green"}
SEED_STYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class MarkScore:
    """One evaluated policy: arm, seed, minute mark, mean score, per-task scores."""

    arm: str
    seed: int
    minute: float
    policy_version: int
    accuracy: float
    scores: dict[str, float]


def load_results(out: Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted(out.glob("*-s*/result.json")):
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    results.sort(key=lambda r: (ARM_ORDER.get(r["arm"], 99), r["seed"]))
    return results


def mark_scores(results: list[dict[str, Any]], warm_eval: dict[str, Any] | None) -> list[MarkScore]:
    """Every evaluated mark; the shared warm start is minute 0 of every arm x seed."""
    scores: list[MarkScore] = []
    for result in results:
        if warm_eval is not None:
            scores.append(_mark(result, 0.0, 1, warm_eval))
        for mark in result.get("marks", []):
            if mark.get("eval"):
                scores.append(
                    _mark(result, float(mark["minute"]), mark["policy_version"], mark["eval"])
                )
    return scores


def _mark(
    result: dict[str, Any], minute: float, version: int, evaluation: dict[str, Any]
) -> MarkScore:
    return MarkScore(
        result["arm"],
        int(result["seed"]),
        minute,
        int(version),
        float(evaluation["accuracy"]),
        {str(k): float(v) for k, v in evaluation.get("scores", {}).items()},
    )


def success_intervals(scores: list[MarkScore]) -> dict[str, dict[float, Interval]]:
    """arm -> minute -> mean held-out success across seeds with its 95% t interval."""
    grouped: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for score in scores:
        grouped[score.arm][score.minute].append(score.accuracy)
    return {
        arm: {minute: mean_interval(values) for minute, values in sorted(by_minute.items())}
        for arm, by_minute in grouped.items()
    }


def paired_intervals(scores: list[MarkScore], first: str, second: str) -> dict[float, Interval]:
    """minute -> mean of ``first - second`` over the seeds both ran, per held-out task,
    with its two-level bootstrap interval. Minute 0 (the shared warm start) is left out."""
    by_key = {(s.arm, s.seed, s.minute): s for s in scores}
    minutes = sorted({s.minute for s in scores if s.minute > 0})
    intervals: dict[float, Interval] = {}
    for minute in minutes:
        differences: dict[int, list[float]] = {}
        for seed in sorted({s.seed for s in scores}):
            a, b = by_key.get((first, seed, minute)), by_key.get((second, seed, minute))
            if a is None or b is None:
                continue
            tasks = sorted(a.scores.keys() & b.scores.keys())
            if tasks:
                differences[seed] = [a.scores[t] - b.scores[t] for t in tasks]
            else:
                differences[seed] = [a.accuracy - b.accuracy]
        if differences:
            intervals[minute] = paired_bootstrap_interval(differences)
    return intervals


# ---------------------------------------------------------------------- plots


def plot_success(intervals: dict[str, dict[float, Interval]], path: Path) -> Path:
    figure, (ax,) = plots.panels(1, columns=1)
    figure.set_size_inches(8, 4)
    ax.set_title("held-out per-turn BFCL success (mean and 95% interval across seeds)", fontsize=10)
    if not intervals:
        plots.empty_note(ax)
    for arm in sorted(intervals, key=lambda a: ARM_ORDER.get(a, 99)):
        _interval_band(
            ax,
            arm,
            intervals[arm],
            offset=0.004 * _span(intervals) * (ARM_ORDER.get(arm, 1) - 1),
            color=ARM_COLORS.get(arm),
            rate=True,
        )
    if intervals:
        _minutes_axis(ax, intervals)
        ax.set_xlabel("minutes since the warm start", fontsize=9)
        ax.set_ylabel("success", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return plots.save(figure, path)


def plot_differences(differences: dict[str, dict[float, Interval]], path: Path) -> Path:
    figure, (ax,) = plots.panels(1, columns=1)
    ax.set_title("paired differences in held-out success (bootstrap 95% interval)", fontsize=10)
    drawn = {name: points for name, points in differences.items() if points}
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
        xs, ys = plots.cumulative(result.get("added_minutes", []), end=result.get("minutes"))
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


def plot_stages(results: list[dict[str, Any]], path: Path, top: int = 6) -> Path:
    figure, (ax,) = plots.panels(1, columns=1)
    figure.set_size_inches(9, 4.5)
    totals: dict[str, float] = defaultdict(float)
    for result in results:
        for stage, seconds in result["summary"]["stage_seconds"].items():
            totals[stage] += seconds
    stages = [s for s, _ in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]
    values: dict[str, float] = {}
    for result in results:
        arm = result["arm"]
        for stage in stages:
            seconds = result["summary"]["stage_seconds"].get(stage, 0.0)
            key = f"{arm}: {stage}"
            values[key] = values.get(key, 0.0) + seconds / 60.0 / _seeds(results, arm)
    plots.bars(ax, values, title="time per stage (mean minutes per seed)", xlabel="minutes")
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
    rate: bool = False,
) -> None:
    """``points`` (minute -> interval) as one band; a ``rate``'s interval is cut to [0, 1]."""
    xs = list(points)
    low = [points[x].low for x in xs]
    high = [points[x].high for x in xs]
    if rate:
        low = [max(0.0, value) for value in low]
        high = [min(1.0, value) for value in high]
    plots.band(ax, name, xs, [points[x].mean for x in xs], low, high, color=color, offset=offset)


def _minutes_axis(ax: Axes, series: dict[str, dict[float, Interval]]) -> None:
    """From minute 0 to the last mark, with a margin (one mark alone is not zoomed into)."""
    span = _span(series)
    last = max((m for points in series.values() for m in points), default=0.0)
    ax.set_xlim(-0.05 * span, last + 0.1 * span)


def _seeds(results: list[dict[str, Any]], arm: str) -> int:
    return max(1, sum(1 for r in results if r["arm"] == arm))


# ---------------------------------------------------------------------- markdown


def _interval_text(interval: Interval) -> str:
    return f"{interval.mean:.3f} [{interval.low:.3f}, {interval.high:.3f}] (n={interval.n})"


def _arm_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for arm in sorted({r["arm"] for r in results}, key=lambda a: ARM_ORDER.get(a, 99)):
        mine = [r["summary"] for r in results if r["arm"] == arm]
        candidates = sum(s["candidates"] for s in mine)
        accepted = sum(s["accepted"] for s in mine)
        growth = [sum(n for o, n in s["pool_by_origin"].items() if o != "seed") for s in mine]
        rows.append(
            [
                arm,
                str(len(mine)),
                _mean_text([s["learner_steps"] for s in mine]),
                _mean_text([s["policy_versions"] for s in mine]),
                _mean_text([sum(s["signals_by_kind"].values()) for s in mine]),
                _mean_text([s["candidates"] for s in mine]),
                f"{accepted / candidates:.3f}" if candidates else "none yet",
                _mean_text(growth),
            ]
        )
    return rows


def _mean_text(values: list[float]) -> str:
    interval = mean_interval(values)
    if interval.n == 1:
        return f"{interval.mean:.1f}"
    return f"{interval.mean:.1f} ± {(interval.high - interval.low) / 2:.1f}"


def render_experiment_report(out: Path, report_dir: Path | None = None) -> Path:
    """Aggregate every ``result.json`` under ``out`` into ``report.md`` + PNGs."""
    report_dir = report_dir or out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    results = load_results(out)
    warm_path = out / "warm" / "eval-v1.json"
    warm_eval = json.loads(warm_path.read_text()) if warm_path.exists() else None
    scores = mark_scores(results, warm_eval)
    success = success_intervals(scores)
    differences = {f"{a} - {b}": paired_intervals(scores, a, b) for a, b in COMPARISONS}
    plot_success(success, report_dir / "heldout.png")
    plot_differences(differences, report_dir / "differences.png")
    plot_data_loop(results, report_dir / "data_loop.png")
    plot_stages(results, report_dir / "stages.png")
    spec_path = out / "experiment.json"
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else {}
    (report_dir / REPORT_FILE).write_text(_markdown(results, spec, success, differences))
    return report_dir / REPORT_FILE


def _markdown(
    results: list[dict[str, Any]],
    spec: dict[str, Any],
    success: dict[str, dict[float, Interval]],
    differences: dict[str, dict[float, Interval]],
) -> str:
    done = ", ".join(f"{r['arm']} s{r['seed']}" for r in results) or "none yet"
    versions = sorted({str(r.get("code_version")) for r in results})
    parts = [
        "# Synthesis ablation: none vs random vs coevolve",
        "",
        f"Spec: {json.dumps(spec, sort_keys=True) if spec else 'unknown'}.",
        f"Finished arm x seed: {done}.",
        f"Code: {', '.join(versions) or 'none yet'}"
        + (" (**arms ran on different code**)" if len(versions) > 1 else "."),
        "",
        "## Held-out success",
        "",
        "![held-out success](heldout.png)",
        "",
    ]
    if success:
        minutes = sorted({m for points in success.values() for m in points})
        arms = sorted(success, key=lambda a: ARM_ORDER.get(a, 99))
        rows = [
            [f"{m:g}"] + [_interval_text(success[a][m]) if m in success[a] else "-" for a in arms]
            for m in minutes
        ]
        parts += [
            "Mean across seeds [95% t interval] (seeds); minute 0 is the shared warm start.",
            "",
            table(["minute", *arms], rows),
        ]
    else:
        parts.append("Held-out success: none yet.")
    parts += ["", "## Paired differences", "", "![differences](differences.png)", ""]
    rows = [
        [name, f"{m:g}", _interval_text(i), "yes" if i.excludes_zero else "no"]
        for name, points in differences.items()
        for m, i in points.items()
    ]
    if rows:
        parts += [
            "Per seed, the difference on each held-out task both arms played; the 95% "
            "interval is a bootstrap over seeds, then tasks (n = seeds).",
            "",
            table(["difference", "minute", "mean [95% interval]", "excludes 0"], rows),
        ]
    else:
        parts.append("Paired differences: none yet (need two arms of the same seed).")
    parts += [
        "",
        "## Data loop and learner per arm",
        "",
        "![data loop](data_loop.png)",
        "",
    ]
    if results:
        parts.append(
            table(
                [
                    "arm",
                    "seeds",
                    "learner steps",
                    "policy versions",
                    "signals",
                    "candidates",
                    "acceptance rate",
                    "pool growth",
                ],
                _arm_rows(results),
            )
        )
        parts.append("")
        parts.append("Means per seed, ± the half-width of the 95% t interval across seeds.")
    parts += ["", "## Time per stage", "", "![stages](stages.png)", ""]
    return "\n".join(parts)
