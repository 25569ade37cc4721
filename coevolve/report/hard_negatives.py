"""Are the failure agent's failures hard negatives? Each of its failures (reward below 1)
set against the target's failures on the same task: its partial credit minus their mean.

The failure agent's rewards come from the learner's step records (its groups carry no
results to pool-store); the target's from the pool's recorded groups. A failure of a task
the target never failed has nothing to be set against and is left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from coevolve.report.run_data import RunData
from coevolve.report.stats import bootstrap_mean_interval

SOLVED = 1.0


@dataclass(frozen=True)
class HardNegatives:
    pairs: int  # failure-agent failures with target failures of the same task
    tasks: int
    failure_agent_mean: float  # mean partial credit of those failures
    target_mean: float  # mean over the same pairs of the target's mean failure on the task
    gap: float  # failure agent minus target, the mean of the per-failure differences
    low: float  # its 95% bootstrap interval
    high: float


def hard_negatives(data: RunData) -> HardNegatives | None:
    """The comparison over the run; None when the failure agent had no such failure."""
    target: dict[str, list[float]] = defaultdict(list)
    for group in data.groups:
        target[group.task_id].extend(s for s in group.scores if s < SOLVED)
    mine: list[tuple[str, float]] = [
        (group.task_id, reward)
        for step in data.steps
        for group in step.groups
        if group.agent == "failure"
        for reward in group.rewards
        if reward < SOLVED
    ]
    return compare_failures(
        [
            (task, reward, sum(target[task]) / len(target[task]))
            for task, reward in mine
            if target.get(task)
        ]
    )


def compare_failures(pairs: Sequence[tuple[str, float, float]]) -> HardNegatives | None:
    """(task, the failure agent's failure, the target's mean failure on the task) triples
    summed up; None when there are none."""
    if not pairs:
        return None
    gaps = [mine - theirs for _, mine, theirs in pairs]
    interval = bootstrap_mean_interval(gaps)
    return HardNegatives(
        pairs=len(pairs),
        tasks=len({task for task, _, _ in pairs}),
        failure_agent_mean=sum(mine for _, mine, _ in pairs) / len(pairs),
        target_mean=sum(theirs for _, _, theirs in pairs) / len(pairs),
        gap=interval.mean,
        low=interval.low,
        high=interval.high,
    )


def hard_negatives_text(found: HardNegatives) -> str:
    return (
        f"{found.pairs} failures of the failure agent on {found.tasks} tasks the target also "
        f"failed: partial credit {found.failure_agent_mean:.3f} against the target's "
        f"{found.target_mean:.3f} on the same tasks; difference {found.gap:+.3f} "
        f"[{found.low:+.3f}, {found.high:+.3f}] (95% bootstrap over the failures). Above 0: "
        "its failures come closer to success than the target's, the point of hard negatives."
    )
