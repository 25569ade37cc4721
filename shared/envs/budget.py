"""An episode's step budget, shared by the environments: as in BFCL, a turn may take
``max_steps_per_turn`` tool steps and one more ends the episode, as do ``max_steps`` in all."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCount:
    """The steps an episode has taken, in all and in its current turn."""

    total: int = 0
    in_turn: int = 0

    def take(self) -> None:
        self.total += 1
        self.in_turn += 1

    def over_budget(self, max_steps: int, max_steps_per_turn: int, turn: int) -> str:
        """Why these steps end the episode (the end reason), or "" while budget is left."""
        if self.in_turn > max_steps_per_turn:
            return f"step budget: {max_steps_per_turn} steps in turn {turn}"
        if self.total >= max_steps:
            return f"step budget: {max_steps} steps in the episode"
        return ""
