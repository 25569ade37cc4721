"""Small messages for tests: only the fields a test is about, the rest plain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coevolve.shared.messages import (
    ChatMessage,
    Experience,
    ExplorationContext,
    Heartbeat,
    Lineage,
    Origin,
    PolicyVersion,
    RolloutGroup,
    Task,
    ToolCall,
    Trajectory,
)

# a BFCL turn and its two ground-truth calls, for prompts about one
CD = ToolCall(name="cd", arguments={"folder": "documents"})
TOUCH = ToolCall(name="touch", arguments={"file_name": "notes.txt"})
NOTES_TASK = Task(
    id="t",
    environment="bfcl",
    user_turns=["Go to documents and create notes.txt."],
    ground_truth=[[CD, TOUCH]],
    # the file system's functions: what the distiller checks advice against
    env_config={"involved_classes": ["GorillaFileSystem"]},
)
# what the abstractor made of a boundary signal on such a turn: an exploration's context
EXPLORATION_CONTEXT = ExplorationContext(
    summary="Half the attempts created the file in the wrong folder.",
    failure_cause="touch before cd",
    instability_pattern="order of cd and touch",
    focus_pattern=["cd before touch"],
    mistakes_to_avoid=["writing in the root"],
)
# the trace a guided exploration's task carries from its signal to its verdict
GUIDED_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def guided_lineage(**fields: Any) -> Lineage:
    """The lineage of a task a guided exploration found: its boundary signal, the
    context, the exploration, the candidate and the trace; ``fields`` replace any of them."""
    found: dict[str, Any] = {
        "signal_id": "sig-1",
        "signal_kind": "boundary",
        "signal_evidence": {"successes": 2, "failures": 2},
        "context": EXPLORATION_CONTEXT,
        "exploration_id": "exp-1",
        "exploration_mode": "guided",
        "exploration_steps": 3,
        "candidate_id": "cand-1",
        "trace_id": GUIDED_TRACE_ID,
    }
    return Lineage(**{**found, **fields})


def experience(text: str, **fields: Any) -> Experience:
    """Advice drawn from a group on another task than ``NOTES_TASK`` (its best attempt
    rewarded 1, its worst 0); ``fields`` replace any of the rest."""
    drawn: dict[str, Any] = {
        "task_id": "other",
        "environment": "bfcl",
        "request": "Create a file.",
        "group_id": "g",
        "trajectory_ids": ["best", "worst"],
        "rewards": [1.0, 0.0],
        "policy_version": 1,
    }
    return Experience(text=text, **{**drawn, **fields})


def policy_version(
    version: int, step: int | None = None, *, sha256: str = "", bucket: str = "b"
) -> PolicyVersion:
    """An announcement of ``version``, trained for ``step`` steps (by default as many)."""
    return PolicyVersion(
        version=version,
        step=version if step is None else step,
        bucket=bucket,
        object_name=f"v{version}",
        base_model="m",
        sha256=sha256,
    )


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


def stepped_trajectory(
    trajectory_id: str,
    task_id: str,
    prompt: Sequence[ChatMessage],
    steps: Sequence[Sequence[ChatMessage]],
    *,
    reward: float = 0.0,
    step_labels: Sequence[int] = (),
) -> Trajectory:
    """A trajectory laid out as ``shared/episodes.py`` lays one out, with stand-in token
    ids: the prompt's messages (3 tokens, loss mask 0), then per step its assistant message
    (2 tokens, mask 1) and the messages that answered it (1 token each, mask 0)."""
    messages = list(prompt)
    mask = [0, 0, 0]
    for step in steps:  # its assistant message first
        messages.extend(step)
        mask.extend([1, 1] + [0] * (len(step) - 1))
    return Trajectory(
        id=trajectory_id,
        task_id=task_id,
        messages=messages,
        token_ids=[7] * len(mask),
        logprobs=[-0.5 if m else 0.0 for m in mask],
        loss_mask=mask,
        reward=reward,
        policy_version=0,
        step_labels=list(step_labels),
    )


def _call(tool_call: ToolCall) -> ChatMessage:
    return ChatMessage(role="assistant", content="", tool_calls=[tool_call])


def _tool(content: str) -> ChatMessage:
    return ChatMessage(role="tool", content=content)


def notes_group() -> RolloutGroup:
    """Two attempts at ``NOTES_TASK``: one solves it (cd, touch, a reply; reward 1), one
    lists the directory and gives up (reward 0)."""
    prompt = [ChatMessage(role="user", content=NOTES_TASK.user_turns[0])]
    solved = stepped_trajectory(
        "solved",
        NOTES_TASK.id,
        prompt,
        [
            [_call(CD), _tool('{"current_working_directory": "documents"}')],
            [_call(TOUCH), _tool("None")],
            [ChatMessage(role="assistant", content="I created notes.txt in documents.")],
        ],
        reward=1.0,
    )
    failed = stepped_trajectory(
        "failed",
        NOTES_TASK.id,
        prompt,
        [
            [_call(ToolCall(name="ls")), _tool('{"current_directory_content": ["documents"]}')],
            [ChatMessage(role="assistant", content="I cannot do that.")],
        ],
        reward=0.0,
    )
    solved.actions.extend(["cd", "touch"])
    failed.actions.append("ls")
    return RolloutGroup(
        task_id=NOTES_TASK.id, origin="seed", policy_version=0, trajectories=[solved, failed]
    )
