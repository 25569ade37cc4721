"""Exponential back-off, the one retry policy of every retry loop: wait ``first_s``, then
``factor`` times as long after every further failure, never longer than ``longest_s``;
``reset`` after a success. With ``jitter`` each wait is drawn uniformly below its bound
(full jitter), so clients that failed together do not retry together."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    first_s: float
    longest_s: float
    factor: float = 2.0
    jitter: bool = False
    rng: random.Random = field(default_factory=random.Random, repr=False)
    _next_s: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.longest_s or self.factor < 1:
            raise ValueError(f"bad back-off {self.first_s}s..{self.longest_s}s x{self.factor}")
        self._next_s = self.first_s

    @property
    def upcoming_s(self) -> float:
        """The bound of the next wait."""
        return self._next_s

    def next_delay(self) -> float:
        """The wait before the next try; the one after it grows."""
        bound = self._next_s
        self._next_s = min(self._next_s * self.factor, self.longest_s)
        return self.rng.uniform(0.0, bound) if self.jitter else bound

    def reset(self) -> None:
        self._next_s = self.first_s
