"""The four signals, as functions of a rollout group and what the monitor remembers.

- forgetting: the task's last ``window`` group scores (a group's score is its mean reward)
  include one >= ``threshold`` while the current score is < ``threshold``.
- boundary: within one group some reward is > ``threshold`` and some is < ``threshold``;
  or, with ``boundary_margin`` set, the group's best and worst rewards differ by at least
  the margin while the worst is < ``threshold``. With 0/1 rewards both read the same; with
  partial credit the margin also finds groups where one attempt matched more of the
  ground truth than another though none solved it (most groups of a policy that solves
  little, which the threshold alone never flags).
- rare: a pattern of the group occurs in under ``rare_theta`` of all patterns of its order
  counted so far (this group included). Patterns are the names of executed calls (order
  1) and adjacent pairs of them within a trajectory (order 2); refused calls do not
  count. Nothing fires before ``rare_min_actions`` function calls have been counted.
- uncertainty: a trajectory's mean token entropy (the mean of its per-turn means in
  ``Trajectory.entropies``) is above the ``uncertainty_quantile`` of
  the trajectory entropies seen before this group (once ``uncertainty_min_samples`` have
  been seen).

:class:`SignalMonitor` runs them over a group, updates the state, rate-limits per task and
builds the :class:`~coevolve.shared.messages.Signal` messages. At most one signal per kind
per group. Signal ids derive from the group id and kind, so reprocessing a group (after a
crash before its state was saved) republishes the same ids, which the bus de-duplicates.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coevolve.services.signal_monitor.config import MonitorConfig
from coevolve.services.signal_monitor.state import (
    MonitorState,
    add_entropy,
    count_patterns,
    pair_pattern,
    push_score,
    quantile,
)
from coevolve.shared.messages import (
    RolloutGroup,
    SignalKind,
    Trajectory,
)


@dataclass(frozen=True)
class Finding:
    kind: SignalKind
    trajectory: Trajectory
    evidence: dict[str, Any]


# --------------------------------------------------------------------------- helpers


def group_score(group: RolloutGroup) -> float:
    rewards = group.rewards()
    return sum(rewards) / len(rewards) if rewards else 0.0


def trajectory_actions(trajectory: Trajectory) -> list[str]:
    """The functions the environment executed for the trajectory, in order, from
    ``actions`` (names, or call strings like ``cd(folder='x')``).

    A call the environment refused (a function that does not exist, malformed arguments)
    is not an action: it shows in the reward, so it feeds boundary and forgetting, and a
    hallucinated name never becomes a rare pattern to explore.
    """
    return [name for action in trajectory.actions if (name := action.split("(", 1)[0].strip())]


def mean_entropy(trajectory: Trajectory) -> float | None:
    if not trajectory.entropies:
        return None
    return sum(trajectory.entropies) / len(trajectory.entropies)


def _lowest_reward(trajectories: Sequence[Trajectory]) -> Trajectory:
    return min(trajectories, key=lambda t: t.reward)


# --------------------------------------------------------------------------- detectors


def detect_forgetting(
    group: RolloutGroup, previous_scores: Sequence[float], config: MonitorConfig
) -> Finding | None:
    """``previous_scores``: the task's window before this group (oldest first)."""
    if not group.trajectories:
        return None
    current = group_score(group)
    considered = list(previous_scores)[-(config.window - 1) :] if config.window > 1 else []
    if current >= config.threshold or not considered:
        return None
    best = max(considered)
    if best < config.threshold:
        return None
    return Finding(
        "forgetting",
        _lowest_reward(group.trajectories),
        {
            "window": [*considered, current],
            "current_score": current,
            "best_in_window": best,
            "threshold": config.threshold,
            "window_size": config.window,
        },
    )


def detect_boundary(group: RolloutGroup, config: MonitorConfig) -> Finding | None:
    if not group.trajectories:
        return None
    above = [t for t in group.trajectories if t.reward > config.threshold]
    below = [t for t in group.trajectories if t.reward < config.threshold]
    best = max(group.trajectories, key=lambda t: t.reward)
    worst = _lowest_reward(group.trajectories)
    crosses = bool(above and below)
    spread = best.reward - worst.reward
    # a small tolerance: partial credit is a float product (0.4 * 1/4 reads 0.1000...02)
    by_margin = (
        config.boundary_margin is not None
        and bool(below)
        and spread >= config.boundary_margin - 1e-9
    )
    if not crosses and not by_margin:
        return None
    return Finding(
        "boundary",
        worst,
        {
            "rewards": group.rewards(),
            "successes": len(above),
            "failures": len(below),
            "threshold": config.threshold,
            "margin": config.boundary_margin,
            "spread": spread,
            "success_trajectory_id": best.id,
            "success_actions": trajectory_actions(best),
        },
    )


def detect_rare(group: RolloutGroup, state: MonitorState, config: MonitorConfig) -> Finding | None:
    """Call after the group's patterns were counted into ``state``."""
    if state.unigram_total < config.rare_min_actions:
        return None
    best: tuple[float, int, str, int, Trajectory] | None = None
    for trajectory in group.trajectories:
        actions = trajectory_actions(trajectory)
        patterns = [(name, 1) for name in actions] + [
            (pair_pattern(a, b), 2) for a, b in itertools.pairwise(actions)
        ]
        for pattern, order in patterns:
            counts, total = (
                (state.unigram_counts, state.unigram_total)
                if order == 1
                else (state.pair_counts, state.pair_total)
            )
            frequency = counts.get(pattern, 0) / total if total else 1.0
            if frequency < config.rare_theta and (best is None or frequency < best[0]):
                best = (frequency, order, pattern, counts.get(pattern, 0), trajectory)
    if best is None:
        return None
    frequency, order, pattern, count, trajectory = best
    return Finding(
        "rare",
        trajectory,
        {
            "pattern": pattern,
            "order": order,
            "count": count,
            "total": state.unigram_total if order == 1 else state.pair_total,
            "frequency": frequency,
            "theta": config.rare_theta,
        },
    )


def detect_uncertainty(
    group: RolloutGroup, state: MonitorState, config: MonitorConfig
) -> Finding | None:
    """Call before the group's entropies were added to ``state``."""
    if len(state.entropy_reservoir) < config.uncertainty_min_samples:
        return None
    scored = [(value, t) for t in group.trajectories if (value := mean_entropy(t)) is not None]
    if not scored:
        return None
    cut = quantile(state.entropy_reservoir, config.uncertainty_quantile)
    value, trajectory = max(scored, key=lambda pair: pair[0])
    if value <= cut:
        return None
    return Finding(
        "uncertainty",
        trajectory,
        {
            "mean_entropy": value,
            "threshold": cut,
            "quantile": config.uncertainty_quantile,
            "samples": len(state.entropy_reservoir),
            "seen": state.entropy_seen,
        },
    )


def detect(group: RolloutGroup, state: MonitorState, config: MonitorConfig) -> list[Finding]:
    """Run every enabled detector over ``group`` and fold the group into ``state``."""
    enabled = set(config.kinds)
    findings: list[Finding | None] = []
    previous = list(state.score_windows.get(group.task_id, []))
    if "forgetting" in enabled:
        findings.append(detect_forgetting(group, previous, config))
    if "boundary" in enabled:
        findings.append(detect_boundary(group, config))
    if "uncertainty" in enabled:
        findings.append(detect_uncertainty(group, state, config))

    if group.trajectories:
        push_score(state, group.task_id, group_score(group), config.window)
    count_patterns(state, (trajectory_actions(t) for t in group.trajectories))
    for trajectory in group.trajectories:
        value = mean_entropy(trajectory)
        if value is not None:
            add_entropy(state, value, config.reservoir_size, config.reservoir_seed)

    if "rare" in enabled:
        findings.append(detect_rare(group, state, config))
    return [f for f in findings if f is not None]


# --------------------------------------------------------------------------- the monitor
