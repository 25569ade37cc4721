"""The judge's automatic checks: replay a candidate's ground truth in a fresh environment.

Three checks, each a criterion of the verdict:

- ``replay_succeeded``: every call of every turn ran without an error;
- ``state_changed_or_result``: the calls changed the environment's state or returned
  something (a result other than nothing / ``None`` / an empty object);
- ``scores_itself``: the candidate, answered by its own ground truth, scores 1.0 with the
  environment's checkers (BFCL's state and response checkers): the solution is
  deterministic and complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coevolve.shared.envs import Environment
from coevolve.shared.messages import Task

EMPTY_RESULTS = frozenset({"", "none", "null", "{}", "[]", '""'})

AUTOMATIC_CRITERIA: tuple[str, ...] = (
    "replay_succeeded",
    "state_changed_or_result",
    "scores_itself",
)


@dataclass(frozen=True)
class ReplayCheck:
    observations: list[str]
    errors: list[str]
    state_changed: bool
    returned_result: bool
    self_score: float
    score_message: str = ""

    @property
    def criteria(self) -> dict[str, bool]:
        return {
            "replay_succeeded": not self.errors,
            "state_changed_or_result": self.state_changed or self.returned_result,
            "scores_itself": self.self_score >= 1.0,
        }

    @property
    def passed(self) -> bool:
        return all(self.criteria.values())

    def problems(self) -> list[str]:
        """Why the candidate fails the automatic checks, in words; [] when it passes."""
        problems: list[str] = []
        if self.errors:
            shown = "; ".join(self.errors[:3])
            more = f" (+{len(self.errors) - 3} more)" if len(self.errors) > 3 else ""
            problems.append(f"replay failed: {shown}{more}")
        if not (self.state_changed or self.returned_result):
            problems.append("replay changed no state and returned no result")
        if self.self_score < 1.0:
            detail = f": {self.score_message}" if self.score_message else ""
            problems.append(f"ground truth scores {self.self_score:.2f} against itself{detail}")
        return problems


def is_result(observation: str) -> bool:
    text = observation.strip()
    return text.lower() not in EMPTY_RESULTS and not text.startswith('{"error"')


def replay_candidate(task: Task, make_env: Callable[[], Environment]) -> ReplayCheck:
    """Replay ``task.ground_truth`` turn by turn from ``task.initial_state``, then score
    the episode against the same ground truth. Blocking (run it in a worker thread)."""
    environment = make_env()
    try:
        environment.reset(task)
        replayed = environment.replay(task.ground_truth)
        score = environment.score()
        report = getattr(environment, "last_report", None)
        message = str(getattr(report, "message", "") or "")
    finally:
        environment.close()
    return ReplayCheck(
        observations=list(replayed.observations),
        errors=list(replayed.errors),
        state_changed=replayed.state_changed,
        returned_result=any(is_result(o) for o in replayed.observations),
        self_score=score,
        score_message=message,
    )
