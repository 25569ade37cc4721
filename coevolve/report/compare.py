"""Two policies' held-out reports, compared task by task.

Both reports must score the same tasks (``coevolve eval --json`` output, ``entries`` with
``entry_id``, ``score``, ``partial_credit``, ``gt_logprob``). Each measure's difference
(first minus second) gets a bootstrap interval over tasks and a paired test's p-value:
the exact sign test for 0/1 success, a paired permutation test for the continuous ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coevolve.report.stats import PairedDelta, paired_delta

# (JSON key of the difference, per-task field, 0/1 measure)
MEASURES: tuple[tuple[str, str, bool], ...] = (
    ("delta_success", "score", True),
    ("delta_partial_credit", "partial_credit", False),
    ("delta_gt_logprob", "gt_logprob", False),
)


class UnpairedReportsError(ValueError):
    """The two reports did not score the same tasks."""


def entries_by_task(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(entry["entry_id"]): entry for entry in report.get("entries", [])}


def compare_reports(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """``first - second`` per measure, over the tasks both scored; keys ``n``,
    ``delta_<measure>`` with ``_ci`` ([low, high]), ``_p`` and ``_n`` (tasks where both
    have the measure)."""
    a, b = entries_by_task(first), entries_by_task(second)
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        raise UnpairedReportsError(
            f"the reports scored different tasks ({len(only)} in one only, e.g. {only[:3]})"
        )
    tasks = sorted(a)
    result: dict[str, Any] = {
        "n": len(tasks),
        "first": first.get("policy"),
        "second": second.get("policy"),
    }
    for key, field, binary in MEASURES:
        pairs = [
            (float(a[t][field]), float(b[t][field]))
            for t in tasks
            if a[t].get(field) is not None and b[t].get(field) is not None
        ]
        if not pairs:
            result.update({key: None, f"{key}_ci": None, f"{key}_p": None, f"{key}_n": 0})
            continue
        delta = paired_delta([p[0] for p in pairs], [p[1] for p in pairs], binary=binary)
        result.update(_delta_keys(key, delta))
        if binary:
            result[f"{key}_wins"] = sum(1 for x, y in pairs if x > y)
            result[f"{key}_losses"] = sum(1 for x, y in pairs if x < y)
    return result


def _delta_keys(key: str, delta: PairedDelta) -> dict[str, Any]:
    return {
        key: delta.mean,
        f"{key}_ci": [delta.low, delta.high],
        f"{key}_p": delta.p,
        f"{key}_n": delta.n,
        f"{key}_test": delta.test,
    }


def describe_comparison(comparison: Mapping[str, Any], names: Sequence[str]) -> str:
    """A few lines a person reads: each measure's difference, interval and p-value."""
    first, second = names
    lines = [f"{first} - {second} on {comparison['n']} paired tasks:"]
    for key, _, binary in MEASURES:
        if comparison.get(key) is None:
            lines.append(f"  {key[6:]:<15} not measured")
            continue
        low, high = comparison[f"{key}_ci"]
        extra = ""
        if binary:
            extra = f" ({comparison[f'{key}_wins']} won, {comparison[f'{key}_losses']} lost)"
        lines.append(
            f"  {key[6:]:<15} {comparison[key]:+.4f}  95% CI [{low:+.4f}, {high:+.4f}]  "
            f"p = {comparison[f'{key}_p']:.4g}{extra}"
        )
    return "\n".join(lines)
