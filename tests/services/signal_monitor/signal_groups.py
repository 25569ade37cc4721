"""Recorded rollout groups for the signal tests, built from the real message structs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from coevolve.shared.messages import ChatMessage, RolloutGroup, Task, ToolCall, Trajectory

_ids = itertools.count()

TASK = Task(
    id="task-a",
    environment="bfcl",
    user_turns=["Move final_report.pdf into the archive folder."],
    initial_state={"GorillaFileSystem": {"root": {}}},
)
OTHER_TASK = Task(id="task-b", environment="bfcl", user_turns=["List the files."])


def trajectory(
    reward: float,
    calls: Sequence[str] = (),
    entropies: Sequence[float] = (),
    task_id: str = TASK.id,
    refused: Sequence[str] = (),
) -> Trajectory:
    """A finished episode whose assistant called ``calls`` (function names), in order, all
    executed, and then ``refused`` (names the environment refused to run)."""
    messages = [ChatMessage(role="user", content="do it")]
    for name in [*calls, *refused]:
        messages.append(
            ChatMessage(
                role="assistant",
                content=f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>',
                tool_calls=[ToolCall(name=name)],
            )
        )
        outcome = "Error: unknown function" if name in refused else "ok"
        messages.append(ChatMessage(role="tool", content=outcome))
    return Trajectory(
        id=f"traj-{next(_ids)}",
        task_id=task_id,
        messages=messages,
        token_ids=[1, 2, 3],
        logprobs=[0.0, -0.5, -0.1],
        loss_mask=[0, 1, 1],
        reward=reward,
        policy_version=3,
        entropies=list(entropies),
        actions=list(calls),
    )


def group(
    rewards: Sequence[float],
    calls: Sequence[Sequence[str]] | None = None,
    entropies: Sequence[Sequence[float]] | None = None,
    task_id: str = TASK.id,
) -> RolloutGroup:
    calls = calls if calls is not None else [()] * len(rewards)
    entropies = entropies if entropies is not None else [()] * len(rewards)
    return RolloutGroup(
        id=f"group-{next(_ids)}",
        task_id=task_id,
        origin="seed",
        policy_version=3,
        trajectories=[
            trajectory(r, c, e, task_id) for r, c, e in zip(rewards, calls, entropies, strict=True)
        ],
    )
