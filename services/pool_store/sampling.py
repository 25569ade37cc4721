"""Drawing a training batch: origin weights, per-origin quotas and random sample keys.

Tasks of one origin have dense sample keys ``low, low + 1, ..., low + used - 1`` (see
schema.py), so a uniform draw of keys is a uniform draw of tasks; keys of retired tasks
or of another environment are drawn and then dropped (rejection sampling).

The dynamic sampler (``SamplingConfig.sampler == "dynamic"``) splits each origin's slots
between tasks never rolled out (drawn by key, as above) and tasks with results, drawn by
weight from their recent scores (``RecentScores``, kept in memory by the store). Nothing
here touches the database.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Final, Literal, TypeVar

import msgspec

from coevolve.shared.messages import ORIGINS

T = TypeVar("T")

# When fewer than this share of an origin's keys match, drawing and dropping keys wastes
# lookups: list the matching keys instead.
MIN_MATCH_FRACTION: Final = 0.05
# Extra keys drawn over the expected need, so one round is nearly always enough.
OVERSAMPLE: Final = 1.25
OVERSAMPLE_EXTRA: Final = 16


@dataclass
class PoolCounts:
    """What sampling needs without a scan: keys used per origin, active tasks per
    (origin, environment). Kept in memory; valid because the store is the file's only
    writer."""

    used_keys: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORIGINS, 0))
    active: Counter[tuple[str, str]] = field(default_factory=Counter)

    def copy(self) -> PoolCounts:
        return PoolCounts(used_keys=dict(self.used_keys), active=Counter(self.active))

    def active_in(self, origin: str, environment: str | None) -> int:
        if environment is not None:
            return self.active[(origin, environment)]
        return sum(count for (o, _), count in self.active.items() if o == origin)


def origin_weights(mix: dict[str, float] | None, available: dict[str, int]) -> dict[str, float]:
    """Weights per origin, over the origins with matching tasks (empty when none has).

    No mix (None or {}) weighs origins by their task counts: every task equally likely.
    """
    present = {origin: count for origin, count in available.items() if count > 0}
    if not mix:
        return {origin: float(count) for origin, count in present.items()}
    unknown = set(mix) - set(ORIGINS)
    if unknown:
        raise ValueError(f"unknown origins in mix: {sorted(unknown)}; known: {list(ORIGINS)}")
    for origin, weight in mix.items():
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mix weight for {origin!r} must be finite and >= 0, got {weight}")
    if not present:
        return {}
    weights = {origin: float(mix[origin]) for origin in present if mix.get(origin, 0.0) > 0}
    if not weights:
        raise ValueError(
            f"mix {mix} gives no weight to any origin with active tasks ({sorted(present)})"
        )
    return weights


def origin_quotas(weights: dict[str, float], size: int, rng: random.Random) -> dict[str, int]:
    """How many tasks of each origin: each batch slot picks its origin by the weights."""
    origins = [origin for origin in ORIGINS if origin in weights]
    picks = Counter(rng.choices(origins, weights=[weights[o] for o in origins], k=size))
    return {origin: picks[origin] for origin in origins if picks[origin]}


@dataclass(eq=False)
class OriginDraw:
    """Distinct uniform draws of one origin's keys until ``need`` of them matched.

    ``active``: how many keys match (``excluded`` ones, that would, not counted).
    """

    origin: str
    low: int
    need: int
    active: int
    used: int
    rng: random.Random
    excluded: Set[int] = frozenset()
    picked: list[int] = field(default_factory=list, init=False)
    _tried: set[int] = field(default_factory=set, init=False, repr=False)

    @property
    def done(self) -> bool:
        return len(self.picked) >= self.need

    @property
    def exact(self) -> bool:
        """Every key of the origin matches: a draw never misses."""
        return self.active == self.used

    @property
    def wants_listing(self) -> bool:
        """Too few keys match (or too few keys at all) for drawing to pay off."""
        if self.exact:
            return False
        return self.active < MIN_MATCH_FRACTION * self.used or self.used <= 4 * self.need

    def next_keys(self) -> list[int]:
        """Untried keys, enough that about ``need`` of them should match."""
        missing = self.need - len(self.picked)
        if missing <= 0:
            return []
        if self.exact:
            count = missing
        else:
            count = math.ceil(missing * self.used / self.active * OVERSAMPLE) + OVERSAMPLE_EXTRA
        count = min(count, self.used - len(self._tried))
        drawn: list[int] = []
        while len(drawn) < count:
            offset = self.rng.randrange(self.used)
            if offset not in self._tried:
                self._tried.add(offset)
                drawn.append(self.low + offset)
        return drawn

    def keep(self, matching_keys: list[int]) -> None:
        """Record keys that matched, in draw order, up to ``need``."""
        kept = [key for key in matching_keys if key not in self.excluded]
        self.picked.extend(kept[: self.need - len(self.picked)])

    def pick_from(self, matching_keys: list[int]) -> None:
        """Draw the rest from a complete list of matching keys."""
        chosen = set(self.picked)
        rest = [key for key in matching_keys if key not in chosen and key not in self.excluded]
        self.picked.extend(self.rng.sample(rest, min(len(rest), self.need - len(self.picked))))


# --------------------------------------------------------------------------- dynamic sampling

Sampler = Literal["uniform", "dynamic"]

# A trajectory with at least this score solved its task (scores lie in [0, 1]).
SOLVED_SCORE: Final = 1.0


class SamplingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How pool-store picks tasks within an origin (docs/pool-store.md, "Dynamic sampling").

    The origin mix is applied first either way; this only decides which tasks of an origin.
    """

    # "dynamic": prefer tasks whose recent scores differ (their groups carry a gradient);
    # "uniform": every active task of an origin equally likely (the sampler before this one)
    sampler: Sampler = "dynamic"
    # recent trajectories per task that decide whether its scores differ (2 groups of 8)
    window: int = 16
    # least share of an origin's slots for tasks never rolled out, while it has any; they
    # also weigh like a mixed task, so in a fresh pool nearly every slot explores
    unseen_share: float = 0.25
    # weight of a task whose recent scores are all equal (always failed, or always solved
    # but not yet retired), against 1 for a task with differing scores; above 0 so a failed
    # task is still tried now and then and can come back once the policy improves
    uniform_weight: float = 0.05
    # retire a task (status "retired") after this many consecutive groups in which every
    # trajectory solved it; 0 never retires. Only the dynamic sampler retires
    retire_after: int = 3

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0.0 <= self.unseen_share <= 1.0:
            raise ValueError(f"unseen_share must lie in [0, 1], got {self.unseen_share}")
        if not 0.0 < self.uniform_weight <= 1.0:
            raise ValueError(f"uniform_weight must lie in (0, 1], got {self.uniform_weight}")
        if self.retire_after < 0:
            raise ValueError(f"retire_after must be >= 0, got {self.retire_after}")

    @property
    def dynamic(self) -> bool:
        return self.sampler == "dynamic"


@dataclass(frozen=True)
class TaskScores:
    """An active task's recent scores, oldest first; only tasks with results have one."""

    origin: str
    environment: str
    sample_key: int
    recent: tuple[float, ...]
    # consecutive most recent groups in which every trajectory solved the task
    solved_streak: int = 0

    @property
    def mixed(self) -> bool:
        """Recent scores differ: the task's next group likely carries a gradient."""
        return min(self.recent) < max(self.recent)

    def weight(self, config: SamplingConfig) -> float:
        return 1.0 if self.mixed else config.uniform_weight

    def with_group(self, scores: Sequence[float], window: int) -> TaskScores:
        """These scores after one more group (``scores`` not empty)."""
        solved = all(score >= SOLVED_SCORE for score in scores)
        return TaskScores(
            origin=self.origin,
            environment=self.environment,
            sample_key=self.sample_key,
            recent=tuple(deque([*self.recent, *scores], maxlen=window)),
            solved_streak=self.solved_streak + 1 if solved else 0,
        )


class RecentScores:
    """``TaskScores`` of the active tasks that have results, by origin.

    Kept in memory by the store (its file's only writer) and loaded when it opens, so a
    draw needs no query over the results.
    """

    def __init__(self) -> None:
        self._by_origin: dict[str, dict[str, TaskScores]] = {origin: {} for origin in ORIGINS}
        self._origin_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._origin_of)

    def get(self, task_id: str) -> TaskScores | None:
        origin = self._origin_of.get(task_id)
        return None if origin is None else self._by_origin[origin][task_id]

    def put(self, task_id: str, scores: TaskScores) -> None:
        self._by_origin[scores.origin][task_id] = scores
        self._origin_of[task_id] = scores.origin

    def drop(self, task_ids: Sequence[str]) -> None:
        for task_id in task_ids:
            origin = self._origin_of.pop(task_id, None)
            if origin is not None:
                del self._by_origin[origin][task_id]

    def of(self, origin: str, environment: str | None) -> list[TaskScores]:
        """An origin's tasks with results (in ``environment``), in sample-key order so a
        seeded draw does not depend on the order results arrived in."""
        scores = self._by_origin[origin].values()
        matching = [s for s in scores if environment in (None, s.environment)]
        return sorted(matching, key=lambda s: s.sample_key)

    def keys(self, origin: str) -> frozenset[int]:
        return frozenset(s.sample_key for s in self._by_origin[origin].values())


def unseen_probability(unseen: int, seen_weight: float, unseen_share: float) -> float:
    """Chance that one slot of an origin goes to a task never rolled out.

    Unseen tasks weigh 1 each, like a task with differing scores, and get at least
    ``unseen_share`` while there are any.
    """
    if unseen == 0:
        return 0.0
    if seen_weight <= 0:
        return 1.0
    return max(unseen_share, unseen / (unseen + seen_weight))


def split_slots(
    quota: int, unseen: int, seen: int, probability: float, rng: random.Random
) -> tuple[int, int]:
    """(unseen slots, seen slots) of an origin's ``quota``, moving slots to the other side
    where one side has too few distinct tasks. Seen slots may still exceed ``seen`` (then
    the batch repeats tasks, as the uniform sampler does)."""
    if 0.0 < probability < 1.0:
        drawn = sum(rng.random() < probability for _ in range(quota))
    else:  # no random draw: without results the batch is the uniform sampler's
        drawn = quota if probability >= 1.0 else 0
    to_unseen = min(drawn, unseen)
    to_seen = quota - to_unseen
    if to_seen > seen:
        moved = min(to_seen - seen, unseen - to_unseen)
        to_unseen += moved
        to_seen -= moved
    return to_unseen, to_seen


def weighted_sample(
    items: Sequence[T], weights: Sequence[float], count: int, rng: random.Random
) -> list[T]:
    """``count`` distinct items, each next one drawn with probability proportional to its
    weight among those left (Efraimidis-Spirakis keys; weights > 0)."""
    keyed = ((rng.random() ** (1.0 / weight), index) for index, weight in enumerate(weights))
    return [items[index] for _, index in heapq.nlargest(count, keyed)]
