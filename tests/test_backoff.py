"""The back-off helper of the retry loops."""

from __future__ import annotations

import random

import pytest

from coevolve.shared.runtime.backoff import Backoff


def test_waits_double_up_to_the_longest_and_start_over_after_a_reset() -> None:
    backoff = Backoff(first_s=2.0, longest_s=30.0)
    assert [backoff.next_delay() for _ in range(6)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    backoff.reset()
    assert backoff.next_delay() == 2.0


def test_a_back_off_that_never_waits_or_shrinks_is_refused() -> None:
    for first, longest, factor in ((0.0, 1.0, 2.0), (5.0, 1.0, 2.0), (1.0, 5.0, 0.5)):
        with pytest.raises(ValueError):
            Backoff(first, longest, factor)


def test_full_jitter_draws_each_wait_below_its_bound() -> None:
    backoff = Backoff(first_s=1.0, longest_s=8.0, jitter=True, rng=random.Random(0))
    waits = [backoff.next_delay() for _ in range(200)]
    bounds = [min(2.0**i, 8.0) for i in range(200)]
    assert all(0.0 <= w <= b for w, b in zip(waits, bounds, strict=True))
    assert len(set(waits)) == len(waits)  # drawn, not fixed
    assert backoff.upcoming_s == 8.0
