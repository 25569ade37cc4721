"""The distiller's settings (the ``services.distiller`` section)."""

from __future__ import annotations

import msgspec

from coevolve.shared.config import Settings

SECTION = "distiller"
# the span of one distillation (its seconds: the role-LLM cost in `coevolve report`), and
# its attribute naming what became of the advice: KEPT or the rejection's kind
DISTIL_SPAN = "distiller distil"
OUTCOME_ATTRIBUTE = "coevolve.outcome"
KEPT = "kept"


class DistillerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    # `coevolve up` starts the distiller only when this is true: with it, pool-store puts
    # experiences into rollout jobs and rollout navigates part of each group
    # (rollout.navigation); off since, with synthesis off in both arms, navigating gained
    # nothing measurable on held-out turns over 3 seeds (docs/learning-results.md)
    enabled: bool = False
    # a group's best and worst attempts must differ by this much reward to teach anything
    min_reward_gap: float = 0.2
    # groups waiting for the role LLM; a new one pushes out the oldest (the LLM is slower
    # than rollout on a shared machine, and a fresher group shows the current policy)
    queue_size: int = 4
    # a task with this many experiences gets no more
    max_per_task: int = 2
    # a distillation still running after this long is given up
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0.0 < self.min_reward_gap <= 1.0:
            raise ValueError(
                f"distiller.min_reward_gap must be in (0, 1], not {self.min_reward_gap}"
            )
        for name in ("queue_size", "max_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"distiller.{name} must be at least 1, not {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"distiller.timeout_s must be > 0, not {self.timeout_s}")


def distiller_enabled(settings: Settings) -> bool:
    """Whether ``coevolve up`` should start the distiller (``services.distiller.enabled``)."""
    return settings.section(SECTION, DistillerConfig).enabled
