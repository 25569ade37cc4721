"""Small messages for tests: only the fields a test is about, the rest plain."""

from __future__ import annotations

from collections.abc import Sequence

from coevolve.shared.messages import ChatMessage, Heartbeat, Origin, RolloutGroup, Trajectory


def untokenized_trajectory(
    trajectory_id: str,
    task_id: str,
    messages: Sequence[ChatMessage] = (),
    *,
    reward: float = 0.0,
    policy_version: int = 0,
    actions: Sequence[str] = (),
    entropies: Sequence[float] = (),
) -> Trajectory:
    """A trajectory without tokens, for code that reads its messages, reward or actions."""
    return Trajectory(
        id=trajectory_id,
        task_id=task_id,
        messages=list(messages),
        token_ids=[],
        logprobs=[],
        loss_mask=[],
        reward=reward,
        policy_version=policy_version,
        actions=list(actions),
        entropies=list(entropies),
    )


def rewarded_group(
    group_id: str, task_id: str, origin: Origin, version: int, *rewards: float
) -> RolloutGroup:
    """A rollout group of untokenized trajectories with these rewards, for code that reads
    a group's task, origin, version and rewards (not its tokens)."""
    trajectories = [
        untokenized_trajectory(f"{group_id}-{i}", task_id, reward=r, policy_version=version)
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(
        id=group_id,
        task_id=task_id,
        origin=origin,
        policy_version=version,
        trajectories=trajectories,
    )


def heartbeat(
    service: str,
    phase: str = "running",
    *,
    in_flight: int = 0,
    progress_done: int | None = None,
    progress_total: int | None = None,
) -> Heartbeat:
    """A heartbeat of one instance of ``service``."""
    return Heartbeat(
        service=service,
        instance="i",
        pid=1,
        host="h",
        started_at=0.0,
        phase=phase,
        in_flight=in_flight,
        progress_done=progress_done,
        progress_total=progress_total,
    )
