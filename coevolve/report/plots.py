"""Small matplotlib helpers shared by the run and the experiment reports (Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Series = tuple[Sequence[float], Sequence[float]]

DPI = 90
PANEL_SIZE = (5.2, 3.0)


def panels(count: int, columns: int = 2) -> tuple[plt.Figure, list[Axes]]:
    rows = (count + columns - 1) // columns
    width, height = PANEL_SIZE
    cols = min(columns, count)
    figure, grid = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for extra in axes[count:]:
        extra.set_visible(False)
    return figure, axes[:count]


def save(figure: plt.Figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def empty_note(ax: Axes, text: str = "none yet") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def count_axis(ax: Axes) -> None:
    """A y axis of counts: whole numbers from 0 (a flat zero line otherwise centres on 0)."""
    ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def whole_number_x(ax: Axes) -> None:
    """An x axis of whole numbers (policy versions, steps)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def lines(
    ax: Axes,
    series: Mapping[str, Series],
    *,
    title: str,
    xlabel: str = "minutes since start",
    ylabel: str = "",
    step: bool = False,
    marker: str | None = None,
    legend: bool = False,
    counts: bool = False,
) -> None:
    """One line per named series; "none yet" when every series is empty. A legend is
    drawn for several series, or for one when ``legend``; ``counts``: see count_axis."""
    ax.set_title(title, fontsize=10)
    drawn = False
    for name, (xs, ys) in series.items():
        if len(xs) == 0:
            continue
        drawn = True
        if step:
            ax.step(xs, ys, where="post", label=name)
        else:
            ax.plot(xs, ys, label=name, marker=marker, markersize=3)
    if not drawn:
        empty_note(ax)
        return
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    if counts:
        count_axis(ax)
    if legend or len(series) > 1:
        ax.legend(fontsize=8)


def band(
    ax: Axes,
    name: str,
    xs: Sequence[float],
    centre: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
    color: str | None = None,
    offset: float = 0.0,
) -> None:
    """A line with error bars and a light band for its interval; ``offset`` shifts the
    points sideways so several series at the same x stay apart."""
    shifted = [x + offset for x in xs]
    (line,) = ax.plot(shifted, centre, marker="o", markersize=4, label=name, color=color)
    below = [c - lo for c, lo in zip(centre, low, strict=True)]
    above = [hi - c for c, hi in zip(centre, high, strict=True)]
    ax.errorbar(shifted, centre, yerr=[below, above], fmt="none", capsize=4, color=line.get_color())
    ax.fill_between(shifted, low, high, alpha=0.12, color=line.get_color())


def bars(ax: Axes, values: Mapping[str, float], *, title: str, xlabel: str = "") -> None:
    """Horizontal bars, largest on top; "none yet" when there are none."""
    ax.set_title(title, fontsize=10)
    if not values:
        empty_note(ax)
        return
    ordered = sorted(values.items(), key=lambda kv: kv[1])
    labels = [shorten(k) for k, _ in ordered]
    ax.barh(labels, [v for _, v in ordered], color="tab:blue")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(alpha=0.3, axis="x")


def interval(
    ax: Axes,
    xs: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
    *,
    label: str,
) -> None:
    """A light band from ``low`` to ``high`` (an interval around a line)."""
    ax.fill_between(xs, low, high, alpha=0.15, color="tab:blue", label=label)


def cumulative(times: Sequence[float], start: float = 0.0, end: float | None = None) -> Series:
    """A step curve counting events: (x, running count) from zero at ``start``, held
    flat until ``end`` when given."""
    ordered = sorted(times)
    xs = [start, *ordered]
    ys = [0.0, *(float(i + 1) for i in range(len(ordered)))]
    if end is not None and end > xs[-1]:
        xs.append(end)
        ys.append(ys[-1])
    return xs, ys


def shorten(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
