"""The distiller's work without the bus: a rollout group and its task in, an experience
out (or why none). Advice that is cut off or names a function or argument the task's
environment does not have is not kept (``shared/experience/checks.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from coevolve.services.distiller.config import DistillerConfig
from coevolve.shared.envs import initial_tools
from coevolve.shared.experience import (
    distil_messages,
    insight_schema,
    parse_insight,
    task_request,
)
from coevolve.shared.experience.checks import advice_problem
from coevolve.shared.experience.prompt import INSIGHT_TOKENS
from coevolve.shared.llm.client import LLMOutputError
from coevolve.shared.llm.roles import RoleLLM
from coevolve.shared.messages import Experience, RolloutGroup, Task, Trajectory, derived_id
from coevolve.shared.structured import Rejection


def contrast(group: RolloutGroup, config: DistillerConfig) -> tuple[Trajectory, Trajectory] | None:
    """The group's best and worst attempts (the first of equals), when their rewards
    differ by at least ``min_reward_gap``; None otherwise."""
    trajectories = [t for t in group.trajectories if not t.experience_ids]
    if len(trajectories) < 2:
        return None
    best = max(trajectories, key=lambda t: t.reward)
    worst = min(trajectories, key=lambda t: t.reward)
    if best.reward - worst.reward < config.min_reward_gap:
        return None
    return best, worst


def called_functions(trajectories: Sequence[Trajectory]) -> list[str]:
    """The functions the attempts called, each once, in first-call order."""
    names: dict[str, None] = {}
    for trajectory in trajectories:
        for name in trajectory.actions:
            names.setdefault(name, None)
    return list(names)


async def distil(
    group: RolloutGroup, task: Task, llm: RoleLLM, config: DistillerConfig
) -> Experience | Rejection | None:
    """The experience the distiller draws from ``group``: None when the group shows no
    contrast (only plain, unadvised attempts are compared), a rejection when the role's
    answer cannot be used (not advice, cut off, or naming what the task's environment
    does not have). Raises only ``LLMUnavailable``."""
    pair = contrast(group, config)
    if pair is None:
        return None
    better, worse = pair
    functions = called_functions(pair)
    try:
        response = await llm.chat(
            distil_messages(task, better, worse, functions),
            schema=insight_schema(),
            max_tokens=INSIGHT_TOKENS,
        )
    except LLMOutputError as exc:
        return Rejection(exc.kind, str(exc))
    insight = parse_insight(response.text, response.finish_reason)
    if isinstance(insight, Rejection):
        return insight
    problem = await checked_against_environment(insight, task)
    if problem is not None:
        return problem
    return Experience(
        id=derived_id("experience", group.id),
        text=insight,
        task_id=task.id,
        environment=task.environment,
        request=task_request(task),
        functions=functions,
        group_id=group.id,
        trajectory_ids=[better.id, worse.id],
        rewards=[better.reward, worse.reward],
        policy_version=group.policy_version,
    )


async def checked_against_environment(insight: str, task: Task) -> Rejection | None:
    """Why ``insight`` may not be kept for ``task`` (see ``advice_problem``), or None; a
    task whose environment cannot be set up to list its functions keeps nothing."""
    try:
        tools = await anyio.to_thread.run_sync(initial_tools, task)
    except Exception as exc:  # whatever the environment raises, the advice goes unchecked
        return Rejection("no_tools", f"task {task.id}: its functions are unknown: {exc}")
    return advice_problem(insight, tools)
