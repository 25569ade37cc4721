"""The explorer does not run a call that already failed in its round.

The model is a scripted chat client (the behaviour under test is the loop's, not a
model's); the environment is the real BFCL one, so the failures are the API's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from coevolve.services.explorer.exploration import ExplorationLimits, explore
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm.client import ChatMessages, LLMResponse
from coevolve.shared.llm.roles import RoleLLM, RoleSettings
from coevolve.shared.messages import Task
from coevolve.shared.structured import RejectionCounter

MISSING_ORDER = {"name": "get_order_details", "arguments": {"order_id": 104937}}
WATCHLIST = {"name": "get_watchlist", "arguments": {}}


class ScriptedChat:
    """Answers each request with the next scripted call and remembers what it was asked."""

    name = "scripted"

    def __init__(self, answers: Sequence[dict[str, Any]]) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[ChatMessages, float | None]] = []

    async def chat(
        self,
        messages: ChatMessages,
        *,
        schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> LLMResponse:
        self.asked.append((messages, temperature))
        return LLMResponse(text=json.dumps(self.answers.pop(0)))

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def trading_task() -> Task:
    return next(t for t in seed_tasks() if t.env_config.get("involved_classes") == ["TradingBot"])


def run(chat: ScriptedChat, task: Task, steps: int) -> tuple[Any, RejectionCounter]:
    llm = RoleLLM(role="explorer", client=chat, settings=RoleSettings(temperature=0.7))
    counter = RejectionCounter()
    limits = ExplorationLimits(max_steps=steps)

    async def go() -> Any:
        return await explore(
            llm, lambda: make_environment("bfcl"), task, "Explore.", limits, counter
        )

    return anyio.run(go), counter


def test_a_repeated_failed_call_is_asked_again_warmer_and_the_new_call_runs(
    trading_task: Task,
) -> None:
    chat = ScriptedChat([MISSING_ORDER, MISSING_ORDER, WATCHLIST])
    (rounds, _), counter = run(chat, trading_task, steps=2)
    actions = [s.action.name for s in rounds[0].steps]
    assert actions == ["get_order_details", "get_watchlist"]
    assert [s.ok for s in rounds[0].steps] == [False, True]
    temperatures = [t for _, t in chat.asked]
    assert temperatures[1] == pytest.approx(0.7) and temperatures[2] > temperatures[1]
    second_prompt = chat.asked[1][0][-1]["content"]
    assert "do not repeat" in second_prompt and '"order_id": 104937' in second_prompt
    assert counter.accepted == 2 and counter.total_rejected == 0


def test_a_call_repeated_twice_is_a_rejection_and_is_not_run(trading_task: Task) -> None:
    chat = ScriptedChat([MISSING_ORDER] * 3)
    (rounds, stats), counter = run(chat, trading_task, steps=2)
    assert [s.action.name for s in rounds[0].steps] == ["get_order_details"]
    assert stats.failed_calls == 1
    assert [r.kind for r in stats.rejections] == ["repeated_call"]
    assert counter.rejected["repeated_call"] == 1


def test_a_call_that_succeeded_may_be_made_again(trading_task: Task) -> None:
    chat = ScriptedChat([WATCHLIST, WATCHLIST])
    (rounds, _), counter = run(chat, trading_task, steps=2)
    assert [s.action.name for s in rounds[0].steps] == ["get_watchlist"] * 2
    assert len(chat.asked) == 2 and counter.accepted == 2
