"""What the signal monitor remembers between rollout groups, and how it survives restarts.

Per-task score windows, action-pattern counts, a bounded sample of trajectory entropies,
per-task rate-limit state and the ids of recently processed groups (so a redelivered group
changes nothing). :class:`StateStore` writes the whole state as JSON with an atomic
replace, so a crash leaves either the old or the new file, never half of one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

STATE_VERSION = 1


class TaskBucket(msgspec.Struct, kw_only=True):
    tokens: float
    updated_at: float


class MonitorState(msgspec.Struct, kw_only=True):
    version: int = STATE_VERSION
    score_windows: dict[str, list[float]] = msgspec.field(default_factory=dict)
    unigram_counts: dict[str, int] = msgspec.field(default_factory=dict)
    pair_counts: dict[str, int] = msgspec.field(default_factory=dict)
    unigram_total: int = 0
    pair_total: int = 0
    entropy_reservoir: list[float] = msgspec.field(default_factory=list)
    entropy_seen: int = 0
    last_signal_at: dict[str, float] = msgspec.field(default_factory=dict)
    buckets: dict[str, TaskBucket] = msgspec.field(default_factory=dict)
    recent_groups: list[str] = msgspec.field(default_factory=list)
    groups_processed: int = 0
    emitted: dict[str, int] = msgspec.field(default_factory=dict)
    suppressed: dict[str, int] = msgspec.field(default_factory=dict)


# --------------------------------------------------------------------------- windows


def push_score(state: MonitorState, task_id: str, score: float, window: int) -> None:
    """Append ``score`` to the task's window, keeping the last ``window`` scores."""
    scores = state.score_windows.setdefault(task_id, [])
    scores.append(score)
    del scores[: max(0, len(scores) - window)]


# --------------------------------------------------------------------------- action patterns


def pair_pattern(first: str, second: str) -> str:
    return f"{first}->{second}"


def count_patterns(state: MonitorState, action_sequences: Iterable[Sequence[str]]) -> None:
    """Count each function name and each adjacent pair of names, per trajectory."""
    for actions in action_sequences:
        for name in actions:
            state.unigram_counts[name] = state.unigram_counts.get(name, 0) + 1
            state.unigram_total += 1
        for first, second in itertools.pairwise(actions):
            key = pair_pattern(first, second)
            state.pair_counts[key] = state.pair_counts.get(key, 0) + 1
            state.pair_total += 1


# --------------------------------------------------------------------------- entropy sample


def add_entropy(state: MonitorState, value: float, capacity: int, seed: int = 0) -> None:
    """Reservoir sampling (algorithm R) of every trajectory entropy seen, ``capacity``
    at most. The replacement draw is seeded by the running count, so a restarted monitor
    makes the same choices it would have made without the restart."""
    state.entropy_seen += 1
    if len(state.entropy_reservoir) < capacity:
        state.entropy_reservoir.append(value)
        return
    slot = random.Random(f"{seed}:{state.entropy_seen}").randrange(state.entropy_seen)
    if slot < capacity:
        state.entropy_reservoir[slot] = value


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --------------------------------------------------------------------------- rate limiting


def signal_key(kind: str, task_id: str) -> str:
    return f"{kind}:{task_id}"


def admit_signal(
    state: MonitorState,
    task_id: str,
    kind: str,
    now: float,
    *,
    cooldown_s: float,
    bucket_capacity: float,
    bucket_refill_per_s: float,
) -> str | None:
    """Take the rate-limit decision for one would-be signal and record it.

    Returns None when the signal may go out (its cooldown and token are consumed), else
    the reason it is suppressed: ``"cooldown"`` (same task and kind too recently) or
    ``"task_budget"`` (the task's token bucket is empty).
    """
    key = signal_key(kind, task_id)
    last = state.last_signal_at.get(key)
    if last is not None and now - last < cooldown_s:
        return _suppress(state, "cooldown")
    bucket = state.buckets.get(task_id)
    if bucket is None:
        bucket = state.buckets[task_id] = TaskBucket(tokens=bucket_capacity, updated_at=now)
    elapsed = max(0.0, now - bucket.updated_at)
    bucket.tokens = min(bucket_capacity, bucket.tokens + elapsed * bucket_refill_per_s)
    bucket.updated_at = now
    if bucket.tokens < 1.0:
        return _suppress(state, "task_budget")
    bucket.tokens -= 1.0
    state.last_signal_at[key] = now
    state.emitted[kind] = state.emitted.get(kind, 0) + 1
    return None


def _suppress(state: MonitorState, reason: str) -> str:
    state.suppressed[reason] = state.suppressed.get(reason, 0) + 1
    return reason


# --------------------------------------------------------------------------- processed groups


def remember_group(state: MonitorState, group_id: str, keep: int) -> None:
    state.recent_groups.append(group_id)
    del state.recent_groups[: max(0, len(state.recent_groups) - keep)]
    state.groups_processed += 1


# --------------------------------------------------------------------------- persistence


class StateStore:
    """The state as one JSON file, replaced atomically on every save."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(MonitorState)

    def load(self) -> MonitorState:
        """The saved state; a fresh one when there is none. A file that does not decode
        (which atomic saves should make impossible) is moved aside, not fatal."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return MonitorState()
        try:
            state = self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("signal-monitor state %s unreadable (%s); moved to %s", self.path, exc, aside)
            return MonitorState()
        if state.version != STATE_VERSION:
            raise ValueError(
                f"{self.path}: state version {state.version}, expected {STATE_VERSION}"
            )
        return state

    def save(self, state: MonitorState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(self._encoder.encode(state))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
        _fsync_directory(self.path.parent)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
