"""A trajectory's steps: the assistant messages the policy generated, and their tokens.

``shared/episodes.py`` appends each generation's ids with ``loss_mask`` 1 (the stop token
included, so never empty) and then the rendered observations with ``loss_mask`` 0 (never
empty either: they close the assistant turn), and nothing after the last generation. So
the i-th run of 1s in ``loss_mask`` holds exactly the tokens of the i-th assistant message
the policy generated. The prompt may hold assistant messages too (a per-turn task's
replayed earlier turns): those are not steps, and the steps are the trajectory's last
``len(step_spans(loss_mask))`` assistant messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coevolve.shared.messages import ChatMessage, Trajectory


@dataclass(frozen=True)
class Step:
    """One generated assistant message and what answered it (tool results, the next user
    turn; none after the last step of a finished episode)."""

    action: ChatMessage
    answers: list[ChatMessage]


def step_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of 1s in ``loss_mask``, in order."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for position, value in enumerate(loss_mask):
        if value and start is None:
            start = position
        elif not value and start is not None:
            spans.append((start, position))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask)))
    return spans


def policy_steps(trajectory: Trajectory) -> list[Step]:
    """The trajectory's steps in order; [] when its messages hold fewer assistant messages
    than its mask has runs (a trajectory not built by ``shared/episodes.py``)."""
    count = len(step_spans(trajectory.loss_mask))
    messages = trajectory.messages
    positions = [i for i, message in enumerate(messages) if message.role == "assistant"]
    if count == 0 or count > len(positions):
        return []
    chosen = positions[-count:]
    ends = [*chosen[1:], len(messages)]
    return [
        Step(messages[at], list(messages[at + 1 : end]))
        for at, end in zip(chosen, ends, strict=True)
    ]


def labels_fit(trajectory: Trajectory) -> bool:
    """Whether the trajectory carries one label per step (and so can be trained on them)."""
    labels = trajectory.step_labels
    return bool(labels) and len(labels) == len(step_spans(trajectory.loss_mask))
