"""The attributor role against the real llama.cpp server (the session fixture in
conftest.py, found through the environment as the services find it), greedy decoding:
it labels a group's steps, and a rollout worker with step credit on publishes them."""

from __future__ import annotations

from typing import Any

import pytest

from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.attribution import label_group, labels_fit
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.llm.server import LlamaServer
from coevolve.shared.messages import ChatMessage, RolloutGroup, RolloutJob, ToolCall
from coevolve.shared.structured import RejectionCounter
from tests.support.messages import CD, NOTES_TASK, TOUCH, stepped_trajectory
from tests.support.rollout import published_group, rollout_settings

pytestmark = [pytest.mark.timeout(300), pytest.mark.anyio]

TASK = NOTES_TASK


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def on_server(llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in llama_server.environment().items():
        monkeypatch.setenv(name, value)


def call(tool_call: ToolCall) -> ChatMessage:
    return ChatMessage(role="assistant", content="", tool_calls=[tool_call])


def tool(content: str) -> ChatMessage:
    return ChatMessage(role="tool", content=content)


def bfcl_group() -> RolloutGroup:
    prompt = [ChatMessage(role="user", content=TASK.user_turns[0])]
    solved = stepped_trajectory(
        "solved",
        TASK.id,
        prompt,
        [
            [call(CD), tool('{"current_working_directory": "documents"}')],
            [call(TOUCH), tool("None")],
            [ChatMessage(role="assistant", content="I created notes.txt in documents.")],
        ],
        reward=1.0,
    )
    failed = stepped_trajectory(
        "failed",
        TASK.id,
        prompt,
        [
            [call(ToolCall(name="ls")), tool('{"current_directory_content": ["documents"]}')],
            [ChatMessage(role="assistant", content="I cannot do that.")],
        ],
        reward=0.0,
    )
    return RolloutGroup(
        task_id=TASK.id, origin="seed", policy_version=0, trajectories=[solved, failed]
    )


@pytest.mark.usefixtures("on_server")
async def test_the_attributor_labels_every_step_of_a_group() -> None:
    clients = RoleClients(role_settings({"roles": {"attributor": {"temperature": 0.0}}}))
    counter = RejectionCounter()
    try:
        labelled = await label_group(bfcl_group(), TASK, clients["attributor"], counter)
    finally:
        await clients.aclose()
    assert counter.accepted == 2, counter.snapshot()
    assert [len(t.step_labels) for t in labelled.trajectories] == [3, 2]
    assert all(label in (-1, 1) for t in labelled.trajectories for label in t.step_labels)
    assert all(labels_fit(t) for t in labelled.trajectories)


@pytest.mark.usefixtures("on_server")
async def test_a_rollout_worker_with_step_credit_publishes_labelled_groups(
    settings: Settings,
) -> None:
    """The real worker end to end: NATS, the SmolLM2 engine, BFCL, the attributor."""
    llm: dict[str, Any] = {"roles": {"attributor": {"temperature": 0.0}}}
    rollout_settings(settings, {"enabled": True}, llm)
    actor = RolloutActor(settings)
    job = RolloutJob(task=seed_tasks()[0], group_size=2)
    published = await published_group(settings, actor, job)

    assert published.label_s > 0 and actor.step_credit_s == pytest.approx(published.label_s)
    # greedy, grammar-bound answers: each is one label per step, or refused and counted
    assert actor.attributions.accepted + actor.attributions.total_rejected == 2
    assert actor.attributions.accepted >= 1, actor.attributions.snapshot()
    assert any(labels_fit(t) for t in published.trajectories)
    assert all(labels_fit(t) or not t.step_labels for t in published.trajectories)
