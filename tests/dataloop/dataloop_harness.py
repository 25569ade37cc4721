"""Shared pieces of the data-loop service tests: real BFCL tasks, rollout groups built from
them, a well-formed "remote LLM" brain, and running actors in-process on the test's NATS."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import eval_queries, seed_tasks
from coevolve.shared.messages import (
    ChatMessage,
    Exploration,
    ExplorationRound,
    InteractionStep,
    RolloutGroup,
    Task,
    TaskCandidate,
    ToolCall,
    Trajectory,
    Verdict,
    decode,
    derived_id,
)
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import Actor, ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import CANDIDATES, EXPLORATIONS, VERDICTS
from coevolve.shared.similarity import LeakGuard
from coevolve.shared.toolcalls import format_tool_call
from tests.support.actors import running
from tests.support.fake_llm import Answer, Brain, RoleFakeLLM, offered_functions, prompt_text
from tests.support.messages import untokenized_trajectory
from tests.support.pool_store import pool_answering

CRITERIA_TRUE = {
    "api_matching": True,
    "parameter_usage": True,
    "logical_flow": True,
    "final_result": True,
    "no_failed_or_skipped_steps": True,
}


# pool-store settings whose seed pool holds whole entries too (the default is per-turn
# only), so the groups of filesystem_seed_tasks are of tasks in the pool
# the full BFCL world: the scripted explorer works in the file system
POOL_WITH_ENTRIES: dict[str, object] = {
    "feed_jobs": False,
    "seed_grains": {"turns": 0.8, "entries": 0.2},
    "seed_classes": None,
}


def filesystem_seed_tasks(count: int, missing: Sequence[str] = ()) -> list[Task]:
    """Seed (train-split) tasks with a file system, whose turns the eval leak guard does
    not flag (so a copy of them is caught as a pool duplicate, not as a leak); with
    ``missing``, only tasks whose failed ``trajectory`` misses a call of one of these
    functions (so an exploration aimed at the failure may call them)."""
    guard = LeakGuard(backend="ngram")
    chosen = []
    for task in seed_tasks():
        if "GorillaFileSystem" not in task.env_config["involved_classes"]:
            continue
        later_calls = [c.name for turn in task.ground_truth for c in turn][1:]
        if missing and not set(missing) & set(later_calls):
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
    messages = [
        ChatMessage(role="user", content=task.user_turns[0]),
        ChatMessage(role="assistant", content=format_tool_call(call), tool_calls=[call]),
        ChatMessage(role="tool", content="{}"),
        ChatMessage(role="assistant", content="Done."),
    ]
    return untokenized_trajectory(
        f"traj-{task.id}-{index}",
        task.id,
        messages,
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


def logged_exploration(
    rounds: Sequence[Sequence[tuple[ToolCall, bool]]], task: Task | None = None
) -> Exploration:
    """An exploration of ``task`` (the first file-system seed task) whose rounds made
    these calls, each (call, whether it ran without an error)."""
    return Exploration(
        id="expl-logged",
        mode="guided",
        task=task or filesystem_seed_tasks(1)[0],
        rounds=[
            ExplorationRound(
                steps=[InteractionStep(history=[], action=c, observation="", ok=ok) for c, ok in r]
            )
            for r in rounds
        ],
    )


class WellFormedBrain:
    """Answers every role with well-formed JSON a capable remote model would give.

    The explorer makes a new folder named after its prompt (a new file when its first
    step may only call what a failed trajectory got wrong, among which ``touch``), then
    lists the directory; the abstractor writes the request for the calls its prompt
    shows (the folder's or file's creation, or a listing when nothing was created).
    ``requests`` makes the abstractor's n-th answer another kind the pipeline must
    filter: ``eval_leak`` (an eval query copied), ``duplicate`` (the explored task's
    first turn), ``malformed`` (a function's name), ``code`` (the call written as code
    inside a sentence).
    """

    def __init__(
        self,
        requests: Sequence[str] = (),
        parent: Task | None = None,
        delays: dict[str, float] | None = None,
    ) -> None:
        self.requests = list(requests)
        self.parent = parent
        self.delays = delays or {}
        self.answered = 0
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
        messages = request["messages"]
        if len(messages) <= 2:  # the first step: nothing done yet
            tag = hashlib.sha256(prompt_text(request).encode()).hexdigest()[:6]
            if "mkdir" in offered:
                return {"name": "mkdir", "arguments": {"dir_name": f"review_{tag}"}}
            if "touch" in offered:
                return {"name": "touch", "arguments": {"file_name": f"review_{tag}.txt"}}
        name = next((n for n in ("ls", "pwd") if n in offered), offered[0])
        return {"name": name, "arguments": {}}

    def abstractor(self, request: dict[str, Any]) -> dict[str, Any]:
        kind = self.requests[self.answered] if self.answered < len(self.requests) else "good"
        self.answered += 1
        text = prompt_text(request)
        if kind == "eval_leak":
            return {"description": "An evaluation query, copied.", "request": self.eval_query}
        if kind == "duplicate":
            assert self.parent is not None
            return {"description": "The explored task again.", "request": self.parent.user_turns[0]}
        if kind == "malformed":
            return {"description": "A function name.", "request": "mkdir"}
        folder = re.search(r'dir_name = "([^"]+)"', text)
        file = re.search(r'file_name = "([^"]+)"', text)
        if kind == "code":
            name = folder.group(1) if folder else "x"
            return {
                "description": "A call.",
                "request": f"Please run mkdir(dir_name='{name}') in my current folder for me.",
            }
        if file is not None and folder is None:
            return {
                "description": "Create a file in the current directory.",
                "request": f"Please create a new empty file called '{file.group(1)}' right "
                "here in my current working folder.",
            }
        if folder is not None:
            return {
                "description": "Create a folder in the current directory.",
                "request": f"Please create a new directory called '{folder.group(1)}' right "
                "here in my current working folder.",
            }
        return {
            "description": "List the current directory.",
            "request": "Please list every item in my current folder so I can see what is there.",
        }

    def judge(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "criteria": CRITERIA_TRUE,
            "accept": True,
            "reason": "Every call succeeded and the listing shows the requested folder.",
        }


def serve_data_loop(settings: Settings, brain: Brain, **abstractor: object) -> RoleFakeLLM:
    """Start ``brain`` behind a fake remote LLM and set the data loop's services up for it:
    a pool with whole entries, one short LLM exploration round with the summarizer's context,
    the judge's LLM role on;
    ``abstractor`` adds to (or overrides) its section."""
    fake = RoleFakeLLM(brain).start()
    settings.services.update(
        llm=fake.llm_section(),
        pool_store=POOL_WITH_ENTRIES,
        # the LLM's exploration: these tests script the explorer role (the synthesis that
        # asks no LLM is test_dataloop_e2e.py's substitution test)
        explorer={
            "rounds": 1,
            "max_steps": 2,
            "summarize_aimed": True,
            "substitution_rounds": 0,
            "state_variation_rounds": 0,
            "sibling_parents": 0,
        },
        abstractor={"leak_backend": "ngram", **abstractor},
        judge={"llm_judge": True},  # these tests cover the judge role's path too
    )
    return fake


@dataclass
class Published:
    """The ids of the explorations, candidates and verdicts (their candidates' ids) the
    services publish, as a listener on the bus sees them."""

    explorations: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)
    judged: list[str] = field(default_factory=list)

    async def listen(self, bus: Bus) -> Published:
        for subject in (EXPLORATIONS, CANDIDATES, VERDICTS):
            await bus.nc.subscribe(subject, cb=self._record)
        return self

    async def _record(self, msg: Msg) -> None:
        if msg.subject == EXPLORATIONS:
            self.explorations.append(decode(msg.data, Exploration).id)
        elif msg.subject == CANDIDATES:
            self.candidates.append(decode(msg.data, TaskCandidate).id)
        else:
            self.judged.append(decode(msg.data, Verdict).candidate_id)


@dataclass
class DataLoop:
    """Services running in-process: the test's bus, a client of their seeded pool-store,
    what they publish and their runners."""

    bus: Bus
    pool: PoolClient
    published: Published
    runners: list[ActorRunner]


@asynccontextmanager
async def data_loop(
    settings: Settings, fake: RoleFakeLLM, actors: Sequence[Actor]
) -> AsyncIterator[DataLoop]:
    """Run ``actors`` (pool-store among them) from the moment its pool is seeded until the
    block ends; then stop ``fake`` and close the bus."""
    bus = await Bus.connect(settings.bus, "test")
    try:
        published = await Published().listen(bus)
        async with running(actors) as runners:
            pool = await pool_answering(bus, seeded=True)
            yield DataLoop(bus, pool, published, runners)
    finally:
        fake.stop()
        await bus.close()


@asynccontextmanager
async def explorer_alone(
    settings: Settings, fake: RoleFakeLLM, explorer: Actor
) -> AsyncIterator[tuple[Bus, Published, ActorRunner]]:
    """Run ``explorer`` by itself (no pool-store to wait for) on a bus with the streams
    made, until the block ends; then stop ``fake`` and close the bus."""
    bus = await Bus.connect(settings.bus, "test")
    try:
        await bus.ensure_streams()
        published = await Published().listen(bus)
        async with running([explorer]) as [runner]:
            yield bus, published, runner
    finally:
        fake.stop()
        await bus.close()
