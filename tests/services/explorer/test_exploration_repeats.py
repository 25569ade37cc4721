"""The explorer does not run a call that already failed in its round, and a round aimed
at a failure varies the first call of the rounds before it.

The model is the shared scripted OpenAI endpoint (the behaviour under test is the loop's,
not a model's), reached over HTTP through the role's real client; the environment is the
real BFCL one, so the failures are the API's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.exploration import ExplorationSetup, explore
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.structured import RejectionCounter
from tests.support.fake_llm import FakeOpenAI, completion

MISSING_ORDER = {"name": "get_order_details", "arguments": {"order_id": 104937}}
WATCHLIST = {"name": "get_watchlist", "arguments": {}}


@pytest.fixture(scope="module")
def trading_task() -> Task:
    return next(t for t in seed_tasks() if t.env_config.get("involved_classes") == ["TradingBot"])


def run(
    endpoint: FakeOpenAI,
    answers: Sequence[dict[str, Any]],
    task: Task,
    steps: int,
    rounds: int = 1,
    first_functions: Sequence[str] = (),
    avoid: Sequence[ToolCall] = (),
) -> tuple[Any, RejectionCounter]:
    endpoint.reply(*(completion(json.dumps(answer)) for answer in answers))
    section = {"default": {"base_url": endpoint.base_url, "model": "m", "temperature": 0.7}}
    clients = RoleClients(role_settings(section))
    counter = RejectionCounter()
    config = ExplorerConfig(max_steps=steps, rounds=rounds)

    async def go() -> Any:
        try:
            setup = ExplorationSetup(
                clients["explorer"],
                lambda: make_environment("bfcl"),
                task,
                "Explore.",
                config,
                counter,
                first_functions=first_functions,
                avoid=avoid,
            )
            return await explore(setup)
        finally:
            await clients.aclose()

    return anyio.run(go), counter


def test_a_repeated_failed_call_is_asked_again_warmer_and_the_new_call_runs(
    endpoint: FakeOpenAI, trading_task: Task
) -> None:
    (rounds, _), counter = run(
        endpoint, [MISSING_ORDER, MISSING_ORDER, WATCHLIST], trading_task, steps=2
    )
    actions = [s.action.name for s in rounds[0].steps]
    assert actions == ["get_order_details", "get_watchlist"]
    assert [s.ok for s in rounds[0].steps] == [False, True]
    temperatures = [r["temperature"] for r in endpoint.requests]
    assert temperatures[1] == pytest.approx(0.7) and temperatures[2] > temperatures[1]
    second_prompt = endpoint.requests[1]["messages"][-1]["content"]
    assert "do not repeat" in second_prompt and '"order_id": 104937' in second_prompt
    assert counter.accepted == 2 and counter.total_rejected == 0


def test_a_call_repeated_twice_is_a_rejection_and_is_not_run(
    endpoint: FakeOpenAI, trading_task: Task
) -> None:
    (rounds, stats), counter = run(endpoint, [MISSING_ORDER] * 3, trading_task, steps=2)
    assert [s.action.name for s in rounds[0].steps] == ["get_order_details"]
    assert stats.failed_calls == 1
    assert [r.kind for r in stats.rejections] == ["repeated_call"]
    assert counter.rejected["repeated_call"] == 1


def test_a_call_that_succeeded_may_be_made_again(endpoint: FakeOpenAI, trading_task: Task) -> None:
    (rounds, _), counter = run(endpoint, [WATCHLIST, WATCHLIST], trading_task, steps=2)
    assert [s.action.name for s in rounds[0].steps] == ["get_watchlist"] * 2
    assert len(endpoint.requests) == 2 and counter.accepted == 2


NVDA = {"name": "get_stock_info", "arguments": {"symbol": "NVDA"}}
AAPL = {"name": "get_stock_info", "arguments": {"symbol": "AAPL"}}


@pytest.mark.parametrize(
    ("answers", "first_function", "ran", "asked_again"),
    [
        pytest.param([NVDA, NVDA, AAPL], "get_stock_info", [NVDA, AAPL], True, id="another value"),
        # one valid value (one order to cancel): the variant cannot differ, the round goes on
        pytest.param(
            [NVDA, NVDA, NVDA], "get_stock_info", [NVDA, NVDA], True, id="the same when asked twice"
        ),
        pytest.param(
            [WATCHLIST, WATCHLIST], "get_watchlist", [WATCHLIST] * 2, False, id="no arguments"
        ),
    ],
)
def test_an_aimed_round_asks_again_for_an_earlier_rounds_first_call_with_its_values(
    endpoint: FakeOpenAI,
    trading_task: Task,
    answers: list[dict[str, Any]],
    first_function: str,
    ran: list[dict[str, Any]],
    asked_again: bool,
) -> None:
    """The repeat is asked again, warmer, with the earlier rounds' calls in the prompt; one
    asked twice runs all the same; a first call without arguments may repeat at once."""
    (rounds, stats), counter = run(
        endpoint, answers, trading_task, steps=1, rounds=2, first_functions=[first_function]
    )
    first = [r.steps[0].action for r in rounds]
    assert [{"name": call.name, "arguments": call.arguments} for call in first] == ran
    assert len(endpoint.requests) == 2 + asked_again and not stats.rejections
    assert counter.accepted == 2
    prompts = [request["messages"][-1]["content"] for request in endpoint.requests]
    assert "Earlier rounds" not in prompts[0]
    if asked_again:
        assert "Earlier rounds" in prompts[1] and '"symbol": "NVDA"' in prompts[1]
        assert endpoint.requests[2]["temperature"] > endpoint.requests[1]["temperature"]


def test_an_aimed_round_offers_only_the_other_values_the_state_holds(
    endpoint: FakeOpenAI, trading_task: Task
) -> None:
    run(endpoint, [NVDA, AAPL], trading_task, steps=1, rounds=2, first_functions=["get_stock_info"])
    first_schema = json.dumps(endpoint.requests[0]["response_format"])
    second = endpoint.requests[1]["response_format"]["json_schema"]["schema"]
    offered = second["properties"]["arguments"]["properties"]["symbol"]["enum"]
    assert '"enum"' not in first_schema
    assert "NVDA" not in offered and "AAPL" in offered and len(offered) >= 3


def test_the_first_round_varies_from_the_parents_expected_call(
    endpoint: FakeOpenAI, trading_task: Task
) -> None:
    expected = ToolCall(name="get_stock_info", arguments={"symbol": "NVDA"})
    run(
        endpoint,
        [AAPL],
        trading_task,
        steps=1,
        first_functions=["get_stock_info"],
        avoid=[expected],
    )
    schema = endpoint.requests[0]["response_format"]["json_schema"]["schema"]
    offered = schema["properties"]["arguments"]["properties"]["symbol"]["enum"]
    assert "NVDA" not in offered and "AAPL" in offered
    assert "Earlier rounds" not in endpoint.requests[0]["messages"][-1]["content"]
