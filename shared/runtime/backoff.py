"""Exponential back-off for the retry loops: wait ``first_s``, then twice as long after
every further failure, never longer than ``longest_s``; ``reset`` after a success."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    first_s: float
    longest_s: float
    factor: float = 2.0
    _next_s: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.longest_s or self.factor < 1:
            raise ValueError(f"bad back-off {self.first_s}s..{self.longest_s}s x{self.factor}")
        self._next_s = self.first_s

    def next_delay(self) -> float:
        """The wait before the next try; the one after it grows."""
        delay = self._next_s
        self._next_s = min(self._next_s * self.factor, self.longest_s)
        return delay

    def reset(self) -> None:
        self._next_s = self.first_s
