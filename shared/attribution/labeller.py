"""Labelling a rollout group's steps with the attributor role, one call per trajectory."""

from __future__ import annotations

import logging

import msgspec

from coevolve.shared.attribution.prompt import (
    attribution_messages,
    label_tokens,
    labels_schema,
    parse_labels,
)
from coevolve.shared.attribution.steps import policy_steps
from coevolve.shared.llm.client import LLMOutputError
from coevolve.shared.llm.roles import RoleLLM
from coevolve.shared.messages import RolloutGroup, Task, Trajectory
from coevolve.shared.structured import Rejection, RejectionCounter

log = logging.getLogger(__name__)


async def label_trajectory(
    trajectory: Trajectory, task: Task, llm: RoleLLM
) -> list[int] | Rejection:
    """One label per step of ``trajectory`` (+1 GOOD, -1 BAD); [] without asking when it
    has no step. Raises only ``LLMUnavailable``."""
    steps = policy_steps(trajectory)
    if not steps:
        return []
    try:
        response = await llm.chat(
            attribution_messages(task, trajectory, steps),
            schema=labels_schema(len(steps)),
            max_tokens=label_tokens(len(steps)),
        )
    except LLMOutputError as exc:
        return Rejection(exc.kind, str(exc))
    return parse_labels(response.text, len(steps), response.finish_reason)


async def label_group(
    group: RolloutGroup,
    task: Task,
    llm: RoleLLM,
    counter: RejectionCounter | None = None,
) -> RolloutGroup:
    """``group`` with ``step_labels`` filled on each trajectory the attributor answered
    usably; one whose answer is unusable keeps empty labels (logged, and counted in
    ``counter``). The calls go one after another: the local server takes one at a time,
    and a rollout worker has nothing else to do meanwhile. Raises only ``LLMUnavailable``
    (nothing labelled then)."""
    trajectories: list[Trajectory] = []
    for trajectory in group.trajectories:
        outcome = await label_trajectory(trajectory, task, llm)
        if counter is not None and (isinstance(outcome, Rejection) or outcome):
            counter.record(outcome)
        if isinstance(outcome, Rejection):
            log.warning(
                "trajectory %s: attributor output rejected (%s): %s",
                trajectory.id,
                outcome.kind,
                outcome.reason,
            )
            outcome = []
        trajectories.append(msgspec.structs.replace(trajectory, step_labels=outcome))
    return msgspec.structs.replace(group, trajectories=trajectories)
