"""Step labelling in rollout when it goes wrong: the group is never lost.

The attributor that answers for real is in tests/llm/test_step_credit_real_server.py;
here its endpoint is down (a closed port), hangs, or answers garbage over real HTTP.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import pytest

from coevolve.services.rollout.actor import RolloutActor
from coevolve.services.rollout.config import StepCreditConfig
from coevolve.services.rollout.handler import attribute_steps
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import LLMResponse, RoleClients, RoleLLM, RoleSettings, role_settings
from coevolve.shared.messages import ChatMessage, RolloutGroup, RolloutJob, Task, ToolCall
from coevolve.shared.runtime.nats_server import free_port
from coevolve.shared.structured import RejectionCounter
from tests.support.fake_llm import FakeOpenAI, completion
from tests.support.messages import stepped_trajectory
from tests.support.rollout import published_group, rollout_settings

pytestmark = pytest.mark.anyio

TASK = Task(id="t", environment="bfcl", user_turns=["Go to documents."])
PROMPT = [ChatMessage(role="user", content=TASK.user_turns[0])]
CD = ChatMessage(role="assistant", content="", tool_calls=[ToolCall(name="cd")])
RESULT = ChatMessage(role="tool", content="Error: folder is required")
REPLY = ChatMessage(role="assistant", content="Done.")


def group(*rewards: float) -> RolloutGroup:
    trajectories = [
        stepped_trajectory(f"x{i}", TASK.id, PROMPT, [[CD, RESULT], [REPLY]], reward=reward)
        for i, reward in enumerate(rewards)
    ]
    return RolloutGroup(
        id="g", task_id=TASK.id, origin="seed", policy_version=0, trajectories=trajectories
    )


def down_endpoint() -> dict[str, Any]:
    """An attributor endpoint nothing listens on, given up on within a second or two."""
    return {
        "base_url": f"http://127.0.0.1:{free_port()}/v1",
        "model": "m",
        "max_retries": 1,
        "give_up_after_s": 1.0,
        "backoff_base_s": 0.05,
        "connect_timeout_s": 0.5,
    }


def attributor(section: dict[str, Any]) -> RoleClients:
    return RoleClients(role_settings({"roles": {"attributor": section}}))


async def test_an_endpoint_that_is_down_leaves_the_group_unlabelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clients = attributor(down_endpoint())
    try:
        with caplog.at_level(logging.WARNING):
            attributed = await attribute_steps(
                group(1.0, 0.0), TASK, clients["attributor"], StepCreditConfig(enabled=True)
            )
    finally:
        await clients.aclose()
    assert attributed.outcome == "failed"
    assert [t.step_labels for t in attributed.group.trajectories] == [[], []]
    assert attributed.group.trajectories == group(1.0, 0.0).trajectories
    assert attributed.group.label_s == attributed.seconds > 0
    assert "step labelling failed" in caplog.text and "published unlabelled" in caplog.text


class Hanging:
    """An endpoint that never answers."""

    name = "hanging"

    async def chat(self, messages: Any, **options: Any) -> LLMResponse:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        return None


async def test_labelling_past_its_timeout_leaves_the_group_unlabelled() -> None:
    llm = RoleLLM("attributor", Hanging(), RoleSettings())
    config = StepCreditConfig(enabled=True, timeout_s=0.2)
    with anyio.fail_after(10):
        attributed = await attribute_steps(group(1.0, 0.0), TASK, llm, config)
    assert attributed.outcome == "timed_out"
    assert all(not t.step_labels for t in attributed.group.trajectories)
    assert attributed.seconds >= 0.2


def labels(*verdicts: str) -> str:
    return json.dumps({"labels": [{"step": i + 1, "verdict": v} for i, v in enumerate(verdicts)]})


async def test_an_unusable_answer_leaves_that_trajectory_unlabelled_and_is_counted() -> None:
    server = FakeOpenAI().start()
    server.reply(completion(labels("BAD", "GOOD")), completion(labels("GOOD")))
    clients = attributor({"base_url": server.base_url, "model": "m", "api_key_env": None})
    counter = RejectionCounter()
    try:
        attributed = await attribute_steps(
            group(1.0, 0.0), TASK, clients["attributor"], StepCreditConfig(enabled=True), counter
        )
    finally:
        await clients.aclose()
        server.stop()
    assert attributed.outcome == "labelled"
    assert [t.step_labels for t in attributed.group.trajectories] == [[-1, 1], []]
    assert counter.accepted == 1 and counter.rejected == {"wrong_count": 1}
    # each request's schema asks for exactly one label per step
    items = [r["response_format"]["json_schema"]["schema"] for r in server.requests]
    assert [s["properties"]["labels"]["minItems"] for s in items] == [2, 2]


async def test_uniform_groups_are_left_alone_when_so_configured() -> None:
    server = FakeOpenAI().start()
    clients = attributor({"base_url": server.base_url, "model": "m", "api_key_env": None})
    config = StepCreditConfig(enabled=True, label_uniform_groups=False)
    uniform = group(0.0, 0.0)
    try:
        attributed = await attribute_steps(uniform, TASK, clients["attributor"], config)
    finally:
        await clients.aclose()
        server.stop()
    assert attributed.outcome == "uniform_skipped" and server.requests == []
    assert attributed.group == uniform


def test_step_credit_is_off_by_default_and_needs_a_positive_timeout() -> None:
    assert not StepCreditConfig().enabled and StepCreditConfig().label_uniform_groups
    with pytest.raises(ValueError, match="timeout_s"):
        StepCreditConfig(timeout_s=0)


async def test_the_service_publishes_the_group_unlabelled_when_the_attributor_is_down(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The real worker: real NATS, the real engine and environment; only the attributor's
    endpoint is missing."""
    rollout_settings(settings, {"enabled": True}, {"roles": {"attributor": down_endpoint()}})
    actor = RolloutActor(settings)
    job = RolloutJob(task=seed_tasks()[0], group_size=2)
    with caplog.at_level(logging.WARNING, logger="coevolve.services.rollout.handler"):
        published = await published_group(settings, actor, job)
    assert len(published.trajectories) == 2
    assert all(not t.step_labels for t in published.trajectories)
    assert published.label_s > 0  # the attributor's time is on record, failed or not
    assert "published unlabelled" in caplog.text
    assert actor.step_credit_s == pytest.approx(published.label_s)
