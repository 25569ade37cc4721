"""The distiller keeps only complete advice that names the task's environment's own
functions and arguments: real BFCL classes (MessageAPI, TradingBot), the role answering
through a real HTTP endpoint that stands in for the remote LLM."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coevolve.services.distiller.config import DistillerConfig
from coevolve.services.distiller.handler import distil
from coevolve.shared.envs import initial_tools
from coevolve.shared.experience.checks import advice_problem
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.messages import Experience, Task
from coevolve.shared.structured import Rejection
from tests.support.fake_llm import FakeOpenAI, completion
from tests.support.messages import notes_group

STOCK_TASK = Task(
    id="stock-turn",
    environment="bfcl",
    user_turns=["Check the price of NAPD and message it to my broker, user USR002."],
    env_config={"involved_classes": ["MessageAPI", "TradingBot"]},
)
# answers the distiller role gave in a run, word for word
CUT_OFF = "When asked to get_stock_info, call get_stock_info and write: {"
WRONG_ARGUMENT = "When asked to call send_message(symbol='NAPD', ...)"
SOUND = (
    "When asked to report a stock's price, call get_stock_info with its symbol, then "
    "send_message to the receiver_id the user gave."
)


@pytest.fixture(scope="module")
def tools() -> list[dict[str, Any]]:
    return initial_tools(STOCK_TASK)


@pytest.mark.parametrize(
    ("advice", "kind"),
    [
        (CUT_OFF, "incomplete"),
        (WRONG_ARGUMENT, "unknown_argument"),
        ("When asked to trade, call place_order(symbol='NAPD', amount=5", "incomplete"),
        ('When asked to message, call send_message with "hello', "incomplete"),
        ("When asked for a price, call get_stock_info and", "incomplete"),
        ("When asked for a price, call fetch_quote(symbol='NAPD') first.", "unknown_function"),
        ("When asked for a price, call fetch_quote first.", "unknown_name"),
        # a condition with nothing to do (kept by a run at 59825e0)
        ("When asked to call remove_stock_from_watchlist(symbol='AAPL')", "incomplete"),
        ("If the user asks get_stock_info(symbol='NAPD') for [price, volume]", "incomplete"),
    ],
)
def test_cut_off_or_unknown_advice_is_dropped_with_its_reason(
    tools: list[dict[str, Any]], advice: str, kind: str
) -> None:
    problem = advice_problem(advice, tools)
    assert problem is not None and problem.kind == kind, problem


@pytest.mark.parametrize(
    "advice",
    [
        SOUND,
        "When asked about the user's stock, call get_stock_info(symbol='NAPD') first.",
        # a quoted value and a file name are values, not names
        "When asked to send a file, call send_message(receiver_id='USR002', message='a_b').",
        "When asked to share report_final.txt, call send_message with its name (not the path).",
        "If the price is asked for then call get_stock_info(symbol='NAPD').",
        "Call get_stock_info(symbol='NAPD') when asked for a price.",
    ],
)
def test_complete_advice_naming_the_environments_functions_is_kept(
    tools: list[dict[str, Any]], advice: str
) -> None:
    assert advice_problem(advice, tools) is None


def test_the_functions_are_the_tasks_environments(tools: list[dict[str, Any]]) -> None:
    names = {tool["function"]["name"] for tool in tools}
    assert {"send_message", "get_stock_info"} <= names
    # send_message exists, but symbol is another function's argument
    assert advice_problem(WRONG_ARGUMENT, tools) is not None
    assert (
        advice_problem("When asked for a price, call get_stock_info(symbol='NAPD').", tools) is None
    )


def insight(text: str) -> Any:
    return completion(json.dumps({"insight": text}))


@pytest.mark.anyio
async def test_the_distiller_keeps_only_the_sound_answer(endpoint: FakeOpenAI) -> None:
    endpoint.reply(insight(CUT_OFF), insight(WRONG_ARGUMENT), insight(SOUND))
    clients = RoleClients(role_settings({"default": {"base_url": endpoint.base_url, "model": "m"}}))
    try:
        # the group's attempts only need to differ in reward: the answers are scripted
        outcomes = [
            await distil(notes_group(), STOCK_TASK, clients["distiller"], DistillerConfig())
            for _ in range(3)
        ]
    finally:
        await clients.aclose()
    cut_off, wrong_argument, sound = outcomes
    assert isinstance(cut_off, Rejection) and cut_off.kind == "incomplete"
    assert isinstance(wrong_argument, Rejection) and wrong_argument.kind == "unknown_argument"
    assert isinstance(sound, Experience) and sound.text == SOUND


@pytest.mark.anyio
async def test_advice_for_a_task_whose_functions_are_unknown_is_not_kept(
    endpoint: FakeOpenAI,
) -> None:
    endpoint.reply(insight(SOUND))
    clients = RoleClients(role_settings({"default": {"base_url": endpoint.base_url, "model": "m"}}))
    unknown = Task(id="no-classes", environment="bfcl", user_turns=["Check NAPD."])
    try:
        outcome = await distil(notes_group(), unknown, clients["distiller"], DistillerConfig())
    finally:
        await clients.aclose()
    assert isinstance(outcome, Rejection) and outcome.kind == "no_tools"
