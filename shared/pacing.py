"""The pacing contract between the data loop and the learner (the ``pacing`` section).

Co-evolving means each learner step sees tasks made from the failures of a recent policy.
The contract says how many accepted tasks the data loop owes per learner step, and how
many policy versions may pass before a child of a signal is first rolled out; pool-store
feeds fresh children first (``pool_store.sampling.fresh_share``), and the learner holds
its next step while the loop is behind (``when_behind``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import msgspec

# learner_waits: the learner holds its next step until the loop has delivered what it owes
# (or max_wait_s passed); on a machine whose cores the loops share, the loop then gets
# them. none: nothing waits (the loop has its own cores, or no contract is wanted)
WhenBehind = Literal["learner_waits", "none"]


class PacingSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # accepted tasks (verdicts) the data loop delivers per learner step; 0: no contract
    tasks_per_step: float = 1.0
    # learner steps before the contract is held: the first signals need rollouts of the
    # first policy before anything can be explored, abstracted and judged. The debt still
    # counts them: after step s > grace_steps the loop owes tasks_per_step x s (counted
    # from the grace's end, 20 steps owed 18, and run 39 delivered 16 in 19)
    grace_steps: int = 2
    # policy versions that may pass between the rollout that raised a signal and the first
    # rollout of a child accepted from it (reported by `coevolve report` and `status`):
    # pool-store feeds children newest signal first, and one more versions than this behind
    # the newest policy is fresh no more (the sampler weighs it like any task not yet rolled)
    max_versions_to_first_draw: int = 2
    when_behind: WhenBehind = "learner_waits"
    # the longest one learner step waits for the loop: a stalled loop must not stop training
    # (a wait that runs out forgives the debt, and no step waits again until the loop
    # delivers another task: ``PaceLedger``)
    max_wait_s: float = 300.0
    # how often the waiting learner asks pool-store again
    poll_s: float = 5.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tasks_per_step) and self.tasks_per_step >= 0):
            raise ValueError(f"pacing.tasks_per_step must be >= 0, got {self.tasks_per_step}")
        if self.grace_steps < 0 or self.max_versions_to_first_draw < 0:
            raise ValueError("pacing.grace_steps and max_versions_to_first_draw must be >= 0")
        if not (self.max_wait_s >= 0 and self.poll_s > 0):
            raise ValueError("pacing.max_wait_s must be >= 0 and pacing.poll_s > 0")

    @property
    def waits(self) -> bool:
        return self.when_behind == "learner_waits" and self.tasks_per_step > 0

    def owed(self, steps_done: int) -> int:
        """Accepted tasks the loop owes once ``steps_done`` learner steps are done: none
        within the grace, then ``tasks_per_step`` for every step, the grace's included."""
        if steps_done <= self.grace_steps:
            return 0
        return math.floor(self.tasks_per_step * steps_done + 1e-9)

    def shortfall(self, steps_done: int, delivered: int) -> int:
        """Tasks the loop is behind by (0: on pace)."""
        return max(0, self.owed(steps_done) - delivered)


@dataclass
class PaceLedger:
    """The learner's account with the data loop under ``settings``.

    A wait that runs out with the loop still behind (``stall``) forgives the debt, and no
    step waits again until the loop delivers another task; from then the debt counts anew.
    A loop with nothing left to vary then costs one ``max_wait_s``, not one per step: with
    no labels, once D0's joins and swaps were used up, each step waited the whole 300 s.
    """

    settings: PacingSettings
    forgiven: int = 0
    stalled_at: int | None = None  # accepted tasks when the last wait ran out

    def owed(self, steps_done: int) -> int:
        return max(0, self.settings.owed(steps_done) - self.forgiven)

    def shortfall(self, steps_done: int, delivered: int) -> int:
        """Tasks the loop is behind by (0: on pace, or stalled and nothing new since)."""
        if self.stalled_at is not None:
            if delivered <= self.stalled_at:
                return 0
            # delivering again: square from the stall, the new tasks ahead
            self.forgiven = self.settings.owed(steps_done) - self.stalled_at
            self.stalled_at = None
        return max(0, self.owed(steps_done) - delivered)

    def stall(self, delivered: int) -> None:
        """A wait ran out with ``delivered`` accepted tasks and the loop still behind."""
        self.stalled_at = delivered
