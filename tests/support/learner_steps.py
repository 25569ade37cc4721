"""A learner's step records written as its handler writes them, for tests that read them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coevolve.services.learner.handler import append_step_record, step_record
from coevolve.shared.messages import RolloutGroup


def record_step(
    path: Path,
    groups: Sequence[RolloutGroup],
    *,
    step: int,
    versions: tuple[int, int],
    at: float,
    published: bool = True,
) -> None:
    """Append to ``path`` the record of a step on ``groups`` that took the policy from
    ``versions[0]`` to ``versions[1]`` at time ``at`` (a staleness bound of 2)."""
    before, after = versions
    record = step_record(
        groups,
        step=step,
        version=after,
        published=published,
        version_before=before,
        max_staleness=2,
        at=at,
    )
    append_step_record(path, record)
