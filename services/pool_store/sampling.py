"""Drawing a training batch: origin weights, per-origin quotas and random sample keys.

Tasks of one origin have dense sample keys ``low, low + 1, ..., low + used - 1`` (see
schema.py), so a uniform draw of keys is a uniform draw of tasks; keys of retired tasks
or of another environment are drawn and then dropped (rejection sampling). Nothing here
touches the database.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from coevolve.shared.messages import ORIGINS

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


class OriginDraw:
    """Distinct uniform draws of one origin's keys until ``need`` of them matched."""

    def __init__(
        self, origin: str, low: int, need: int, active: int, used: int, rng: random.Random
    ) -> None:
        self.origin = origin
        self.low = low
        self.need = need
        self.active = active
        self.used = used
        self.rng = rng
        self.picked: list[int] = []
        self._tried: set[int] = set()

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
        self.picked.extend(matching_keys[: self.need - len(self.picked)])

    def pick_from(self, matching_keys: list[int]) -> None:
        """Draw the rest from a complete list of matching keys."""
        chosen = set(self.picked)
        rest = [key for key in matching_keys if key not in chosen]
        self.picked.extend(self.rng.sample(rest, min(len(rest), self.need - len(self.picked))))
