"""Shared pieces of the data-loop service tests: real BFCL tasks, rollout groups built from
them, a well-formed "remote LLM" brain, and running actors in-process on the test's NATS."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
from dataloop_fake_llm import Answer, offered_functions, prompt_text

from coevolve.shared.actor import Actor, ActorRunner
from coevolve.shared.bus import Bus
from coevolve.shared.envs.bfcl.tasks import eval_queries, seed_tasks
from coevolve.shared.messages import ChatMessage, RolloutGroup, Task, Trajectory, derived_id
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.similarity import LeakGuard
from coevolve.shared.toolcalls import format_tool_call

CRITERIA_TRUE = {
    "api_matching": True,
    "parameter_usage": True,
    "logical_flow": True,
    "final_result": True,
    "no_failed_or_skipped_steps": True,
}


# pool-store settings whose seed pool holds whole entries too (the default is per-turn
# only), so the groups of filesystem_seed_tasks are of tasks in the pool
POOL_WITH_ENTRIES: dict[str, object] = {
    "feed_jobs": False,
    "seed_grains": {"turns": 0.8, "entries": 0.2},
}


def filesystem_seed_tasks(count: int) -> list[Task]:
    """Seed (train-split) tasks with a file system, whose turns the eval leak guard does
    not flag (so a copy of them is caught as a pool duplicate, not as a leak)."""
    guard = LeakGuard(backend="ngram")
    chosen = []
    for task in seed_tasks():
        if "GorillaFileSystem" not in task.env_config["involved_classes"]:
            continue
        if any(guard.flags(turn)[0] for turn in task.user_turns):
            continue
        chosen.append(task)
        if len(chosen) == count:
            break
    assert len(chosen) == count
    return chosen


def trajectory(task: Task, reward: float, index: int) -> Trajectory:
    """An episode of ``task``: the first ground-truth call, then an answer."""
    call = task.ground_truth[0][0]
    return Trajectory(
        id=f"traj-{task.id}-{index}",
        task_id=task.id,
        messages=[
            ChatMessage(role="user", content=task.user_turns[0]),
            ChatMessage(role="assistant", content=format_tool_call(call), tool_calls=[call]),
            ChatMessage(role="tool", content="{}"),
            ChatMessage(role="assistant", content="Done."),
        ],
        token_ids=[],
        logprobs=[],
        loss_mask=[],
        reward=reward,
        policy_version=1,
        actions=[call.name],
        entropies=[0.5],
    )


def mixed_group(task: Task, rewards: Sequence[float] = (1.0, 0.0, 0.0, 1.0)) -> RolloutGroup:
    """A group with some successes and some failures: a boundary signal."""
    return RolloutGroup(
        id=derived_id("test-group", task.id, *rewards),
        task_id=task.id,
        origin=task.origin,
        policy_version=1,
        trajectories=[trajectory(task, reward, i) for i, reward in enumerate(rewards)],
    )


class WellFormedBrain:
    """Answers every role with well-formed JSON a capable remote model would give.

    The abstractor proposes one good task (a new folder, then a listing: replays cleanly
    and scores 1.0 against itself) and, as ``extras`` asks, drafts the pipeline must
    filter: ``unknown_function``, ``eval_leak`` (an eval query copied), ``duplicate`` (the
    explored task's own turns and calls), ``replay_failure`` (cd into a missing folder).
    """

    def __init__(
        self,
        extras: Sequence[str] = (),
        parent: Task | None = None,
        delays: dict[str, float] | None = None,
    ) -> None:
        self.extras = list(extras)
        self.parent = parent
        self.delays = delays or {}
        long_queries = [q for q in eval_queries() if len(q.split()) >= 12]
        self.eval_query = long_queries[0]

    def __call__(self, role: str, request: dict[str, Any]) -> Answer:
        if delay := self.delays.get(role):
            time.sleep(delay)
        return Answer(json.dumps(getattr(self, role)(request)))

    def summarizer(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "summary": "The agent had to create a document in a sub-folder and failed in "
            "half of the attempts.",
            "failure_cause": "It called touch before changing into the documents folder.",
            "instability_pattern": "Order of cd and file creation.",
            "focus_pattern": ["create folders then list them", "cd before touch"],
            "mistakes_to_avoid": ["creating files in the wrong directory"],
        }

    def explorer(self, request: dict[str, Any]) -> dict[str, Any]:
        offered = offered_functions(request)
        # alternate: a listing, then where we are
        steps = request["messages"][2:]
        preferred = ["ls", "pwd"] if len(steps) % 4 == 0 else ["pwd", "ls"]
        name = next((n for n in preferred if n in offered), offered[0])
        return {"name": name, "arguments": {}}

    def abstractor(self, request: dict[str, Any]) -> dict[str, Any]:
        tag = hashlib.sha256(prompt_text(request).encode()).hexdigest()[:6]
        folder = f"review_{tag}"
        drafts: list[dict[str, Any]] = [
            {
                "description": "Create a folder and confirm it by listing the directory.",
                "turns": [
                    {
                        "request": f"Please create a new directory called '{folder}' right "
                        "here in my current working folder.",
                        "calls": [{"name": "mkdir", "arguments": {"dir_name": folder}}],
                    },
                    {
                        "request": "Then list every item in the current folder so I can "
                        "confirm that the new directory exists.",
                        "calls": [{"name": "ls", "arguments": {}}],
                    },
                ],
            }
        ]
        for extra in self.extras:
            drafts.append(self._extra(extra))
        return {"tasks": drafts}

    def _extra(self, kind: str) -> dict[str, Any]:
        if kind == "unknown_function":
            return {
                "description": "Defragment the disk.",
                "turns": [
                    {
                        "request": "Please defragment my whole disk right now, thank you.",
                        "calls": [{"name": "defragment_disk", "arguments": {}}],
                    }
                ],
            }
        if kind == "eval_leak":
            return {
                "description": "An evaluation query, copied.",
                "turns": [{"request": self.eval_query, "calls": [{"name": "ls", "arguments": {}}]}],
            }
        if kind == "duplicate":
            assert self.parent is not None
            return {
                "description": "The explored task again.",
                "turns": [
                    {
                        "request": request,
                        "calls": [{"name": c.name, "arguments": c.arguments} for c in calls],
                    }
                    for request, calls in zip(
                        self.parent.user_turns, self.parent.ground_truth, strict=True
                    )
                ],
            }
        if kind == "replay_failure":
            return {
                "description": "Enter a folder that does not exist.",
                "turns": [
                    {
                        "request": "Go into the folder named 'no_such_folder_anywhere' and "
                        "stay there please.",
                        "calls": [
                            {"name": "cd", "arguments": {"folder": "no_such_folder_anywhere"}}
                        ],
                    }
                ],
            }
        raise ValueError(kind)

    def judge(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "criteria": CRITERIA_TRUE,
            "accept": True,
            "reason": "Every call succeeded and the listing shows the requested folder.",
        }


@asynccontextmanager
async def running(actors: Sequence[Actor]) -> AsyncIterator[list[ActorRunner]]:
    """Run ``actors`` (each its own ActorRunner) until the block ends."""
    runners = [ActorRunner(actor) for actor in actors]
    async with anyio.create_task_group() as tg:
        for runner in runners:
            tg.start_soon(partial(runner.run, handle_signals=False))
        try:
            yield runners
        finally:
            for runner in runners:
                runner.request_stop()


async def wait_until(
    condition: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if hasattr(outcome, "__await__"):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await anyio.sleep(poll_s)


async def wait_for_pool(bus: Bus, timeout: float = 60.0) -> PoolClient:
    client = PoolClient(bus, timeout_s=5.0)

    async def seeded() -> bool:
        try:
            stats = await client.stats()
        except Exception:
            return False
        return sum(stats.tasks_by_origin.values()) > 0

    await wait_until(seeded, timeout, "pool-store to answer with a seeded pool")
    return client
