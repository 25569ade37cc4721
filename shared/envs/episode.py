"""What every environment keeps of its current episode: its task, its turn and its step
budget. As in BFCL, a turn may take ``max_steps_per_turn`` tool steps and one more ends
the episode, as do ``max_steps`` in all."""

from __future__ import annotations

from dataclasses import dataclass

from coevolve.shared.messages import Task


class EpisodeNotStartedError(RuntimeError):
    """``reset(task)`` must come first."""


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


class EpisodeState:
    """The episode attributes an environment sets (in its constructor and ``reset``), and
    what it reads of them the same way as every other environment."""

    max_steps: int
    max_steps_per_turn: int
    _task: Task | None
    _turn: int
    _steps: StepCount
    _done: bool
    _end_reason: str

    @property
    def task(self) -> Task:
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        return self._task

    @property
    def turn(self) -> int:
        """The current turn's index."""
        return self._turn

    def _check_budget(self) -> None:
        reason = self._steps.over_budget(self.max_steps, self.max_steps_per_turn, self.turn)
        if reason and not self._done:
            self._done, self._end_reason = True, reason
