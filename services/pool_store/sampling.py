"""Drawing a training batch: origin weights, per-origin quotas and random sample keys.

Tasks of one origin have dense sample keys ``low, low + 1, ..., low + used - 1`` (see
schema.py), so a uniform draw of keys is a uniform draw of tasks; keys of retired tasks
or of another environment are drawn and then dropped (rejection sampling).

The learnability sampler (``SamplingConfig.sampler == "learnability"``, the default) and
the dynamic one split a batch's slots between tasks never rolled out (drawn by key, as
above) and tasks with results, drawn by weight from their recent scores (``RecentScores``,
kept in memory by the store). The learnability sampler treats every active task of every
origin as one candidate unless a mix is asked for, weighs it by how much a group on it can
teach (``TaskScores.learnability``) and caps any task's share of the jobs fed
(``JobShares``); the dynamic one works inside each origin of the mix. Nothing here touches
the database.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter, deque
from collections.abc import Collection, Sequence, Set
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

Sampler = Literal["learnability", "dynamic", "uniform"]

# A trajectory with at least this score solved its task (scores lie in [0, 1]).
SOLVED_SCORE: Final = 1.0


class SamplingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """How pool-store picks tasks (docs/pool-store.md, "Sampling by learnability" and
    "Dynamic sampling").

    ``learnability`` (the default): every active task, whatever its origin, is one
    candidate (an explicit mix still splits the slots by origin first); a task weighs by
    how much a group on it can teach, an unseen task by ``unseen_weight``, and no task
    takes more than ``max_task_share`` of the last ``share_window`` jobs fed. ``dynamic``
    and ``uniform`` apply the origin mix first and pick within each origin. Whatever the
    sampler, fresh synthesized tasks take up to ``fresh_share`` of a job feed first.
    """

    # "learnability": weigh every task by 4 x the variance of its recent scores, pool-wide,
    # with a cap on any task's share of jobs; "dynamic": within each origin of the mix,
    # tasks whose recent scores differ weigh 1, the others uniform_weight; "uniform":
    # every active task of an origin equally likely (the sampler before both)
    sampler: Sampler = "learnability"
    # recent trajectories per task that its weight is computed from (2 groups of 8)
    window: int = 16
    # least share of the slots for tasks never rolled out, while there are any
    unseen_share: float = 0.25
    # learnability sampler: weight of a task never rolled out; dynamic: always 1. Ten times
    # uniform_weight, so unseen tasks come before known-uniform ones, and a twentieth of a
    # task with a spread of scores, so those are drawn again: in a default run's regime
    # (bench sampling) the uniform-group share fell from 0.55 (1 and 0.05) to 0.32
    unseen_weight: float = 0.05
    # the least weight of a task with results: an always-failed or always-solved task
    # (learnability 0) is still drawn now and then and comes back once the policy changes
    uniform_weight: float = 0.005
    # retire a task (status "retired") after this many consecutive groups in which every
    # trajectory solved it; 0 never retires. The uniform sampler never retires
    retire_after: int = 3
    # learnability sampler, jobs fed only: a task takes at most this share of any
    # share_window consecutive jobs (floor(max_task_share x share_window) of them); with
    # fewer than about 1/max_task_share active tasks the cap relaxes to 1/tasks
    max_task_share: float = 0.05
    share_window: int = 200
    # every sampler, jobs fed only: synthesized tasks never fed as a job (fresh) take
    # up to this share of each feed's slots (at least one while any waits) before the
    # sampler draws, newest signal first: a child exists to repair its signal's failure
    # now (pacing.max_versions_to_first_draw: how long it stays fresh). A mix that gives
    # synthesized tasks no weight leaves them out; 0 turns it off. At 0.5
    # a 30-minute run's children waited a median 2.5 versions (run 35, docs/main-job.md)
    fresh_share: float = 0.75

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0.0 <= self.unseen_share <= 1.0:
            raise ValueError(f"unseen_share must lie in [0, 1], got {self.unseen_share}")
        if not (math.isfinite(self.unseen_weight) and self.unseen_weight > 0.0):
            raise ValueError(f"unseen_weight must be finite and > 0, got {self.unseen_weight}")
        if not 0.0 < self.uniform_weight <= 1.0:
            raise ValueError(f"uniform_weight must lie in (0, 1], got {self.uniform_weight}")
        if self.retire_after < 0:
            raise ValueError(f"retire_after must be >= 0, got {self.retire_after}")
        if not 0.0 < self.max_task_share <= 1.0:
            raise ValueError(f"max_task_share must lie in (0, 1], got {self.max_task_share}")
        if self.share_window < 1:
            raise ValueError(f"share_window must be >= 1, got {self.share_window}")
        if not 0.0 <= self.fresh_share <= 1.0:
            raise ValueError(f"fresh_share must lie in [0, 1], got {self.fresh_share}")
        if whole_jobs(self.max_task_share, self.share_window) < 1:
            raise ValueError(
                f"max_task_share x share_window must allow a task at least one job: "
                f"{self.max_task_share} x {self.share_window} < 1"
            )

    @property
    def dynamic(self) -> bool:
        return self.sampler == "dynamic"

    @property
    def learnability(self) -> bool:
        return self.sampler == "learnability"

    @property
    def retires(self) -> bool:
        """Whether recorded results retire always-solved tasks."""
        return self.sampler != "uniform" and self.retire_after > 0


def whole_jobs(share: float, window: int) -> int:
    """The whole number of jobs ``share`` of ``window`` allows (float noise forgiven)."""
    return math.floor(share * window + 1e-9)


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

    @property
    def learnability(self) -> float:
        """How much a group on the task can teach, in [0, 1]: 4 x the (population)
        variance of its recent scores. For 0/1 rewards with recent success rate p this is
        4p(1-p): 1 at p = 0.5, 0 for a task always failed or always solved. For partial
        credit it is the spread of the rewards, so a task that always earns the same
        partial score weighs 0 too (its groups carry no gradient), where 4p(1-p) of the
        mean score would not."""
        count = len(self.recent)
        if count == 0 or not self.mixed:
            return 0.0
        mean = sum(self.recent) / count
        variance = sum((score - mean) ** 2 for score in self.recent) / count
        return min(1.0, 4.0 * variance)

    def weight(self, config: SamplingConfig) -> float:
        if config.learnability:
            return max(config.uniform_weight, self.learnability)
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


def unseen_probability(
    unseen: int, seen_weight: float, unseen_share: float, unseen_weight: float = 1.0
) -> float:
    """Chance that one slot goes to a task never rolled out.

    Unseen tasks weigh ``unseen_weight`` each (1, like a task with differing scores, for
    the dynamic sampler) and get at least ``unseen_share`` while there are any.
    """
    if unseen == 0:
        return 0.0
    if seen_weight <= 0:
        return 1.0
    weight = unseen * unseen_weight
    return max(unseen_share, weight / (weight + seen_weight))


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


def spread_unseen(slots: int, unseen: dict[str, int], rng: random.Random) -> dict[str, int]:
    """How many of ``slots`` unseen tasks come from each origin when every unseen task is
    equally likely (drawn without replacement; ``slots`` <= the sum of ``unseen``)."""
    left = {origin: count for origin, count in unseen.items() if count > 0}
    spread: Counter[str] = Counter()
    for _ in range(slots):
        if not left:
            break
        origins = list(left)
        origin = rng.choices(origins, weights=[left[o] for o in origins])[0]
        spread[origin] += 1
        left[origin] -= 1
        if not left[origin]:
            del left[origin]
    return dict(spread)


class JobShares:
    """The tasks (sample keys) of the last jobs fed, for the learnability sampler's cap.

    Keeps the last ``share_window - 1`` jobs: a task may be drawn for the next job only
    while it holds fewer than ``limit`` of them, so it never holds more than ``limit`` of
    any ``share_window`` consecutive jobs (a batch draws a task at most once). Kept in
    memory by the store and rebuilt from the newest recorded groups when the file opens.
    """

    def __init__(self, config: SamplingConfig) -> None:
        self.share = config.max_task_share
        self.window = config.share_window
        self._keys: deque[int] = deque()
        self._counts: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._keys)

    def count(self, key: int) -> int:
        """Jobs of the task among the last ``share_window - 1``."""
        return self._counts[key]

    def record(self, keys: Sequence[int]) -> None:
        """Jobs fed, oldest first."""
        kept = self.window - 1
        for key in keys:
            self._keys.append(key)
            self._counts[key] += 1
            while len(self._keys) > kept:
                old = self._keys.popleft()
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]

    def limit(self, tasks: int) -> int:
        """Jobs of any ``share_window`` consecutive ones that one task may take when
        ``tasks`` tasks can be drawn: ``max_task_share`` of them, relaxed to 1/``tasks``
        (rounded up) when there are too few tasks to fill the window under the cap."""
        capped = whole_jobs(self.share, self.window)
        if tasks <= 0:
            return capped
        return max(capped, math.ceil(self.window / tasks))

    def capped(self, limit: int) -> frozenset[int]:
        """Keys of the tasks that may not be drawn now."""
        return frozenset(key for key, count in self._counts.items() if count >= limit)


@dataclass(frozen=True)
class FreshTask:
    task_id: str
    environment: str
    origin: str
    # the policy version the task answers: its signal's, else the newest one pool-store
    # had results of when the task joined
    version: int


class FreshTasks:
    """Tasks new to the run that were never fed as a rollout job: synthesized tasks
    (children of signals, or of the same machinery unguided) and labelled turns the
    experiment's labelled_control arm added during the run, by sample key. Kept in memory
    by the store and rebuilt when the file opens (the active ones of them without
    recorded results).

    Feeds draw them newest policy version first, in the order they joined within one
    version: children arrive in bursts faster than a learner step's few groups can take
    them, and oldest first made every later burst wait behind the earlier ones (run 43:
    a median 3 versions to a child's first draw, docs/main-job.md)."""

    def __init__(self) -> None:
        # insertion-ordered: a sample key orders only within its origin
        self._by_key: dict[int, FreshTask] = {}
        self._key_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def add(
        self, task_id: str, sample_key: int, environment: str, origin: str, version: int
    ) -> None:
        self._by_key[sample_key] = FreshTask(task_id, environment, origin, version)
        self._key_of[task_id] = sample_key

    def drop_tasks(self, task_ids: Sequence[str]) -> None:
        for task_id in task_ids:
            key = self._key_of.pop(task_id, None)
            if key is not None:
                del self._by_key[key]

    def drop_keys(self, keys: Sequence[int]) -> None:
        for key in keys:
            fresh = self._by_key.pop(key, None)
            if fresh is not None:
                del self._key_of[fresh.task_id]

    def expire(self, newest_version: int, window: int) -> None:
        """Drop the tasks more than ``window`` versions behind ``newest_version``: the
        policy their signal showed is gone, so the sampler weighs them like any task never
        rolled out."""
        stale = [f.task_id for f in self._by_key.values() if newest_version - f.version > window]
        self.drop_tasks(stale)

    def _in_draw_order(self) -> list[tuple[int, FreshTask]]:
        # sorted() is stable: within one version, the order they joined
        return sorted(self._by_key.items(), key=lambda item: -item[1].version)

    def task_ids(self) -> list[str]:
        """In the order the next feeds draw them."""
        return [fresh.task_id for _, fresh in self._in_draw_order()]

    def origin_of(self, key: int) -> str:
        return self._by_key[key].origin

    def first(self, count: int, environment: str | None, origins: Collection[str]) -> list[int]:
        """The keys of the ``count`` next to draw (in ``environment``, of ``origins``)."""
        keys = (
            key
            for key, fresh in self._in_draw_order()
            if environment in (None, fresh.environment) and fresh.origin in origins
        )
        return list(itertools.islice(keys, max(0, count)))


def fresh_slots(share: float, size: int) -> int:
    """Slots of a feed of ``size`` that fresh tasks may take: ``share`` of them, at least
    one (none when ``share`` is 0)."""
    if share <= 0.0 or size <= 0:
        return 0
    return min(size, max(1, whole_jobs(share, size)))
