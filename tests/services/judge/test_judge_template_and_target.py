"""Two judge checks: a request that is a template (a function's name, its description, a
"Details:" list) is refused, and a child task must call what its parent turn failed."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from coevolve.services.judge.checks import (
    check_exercises_failure,
    check_not_template,
    semantic_checks,
    trace_calls,
)
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import Judged, JudgeDeps, judge_candidate
from coevolve.shared.envs.bfcl.catalog import function_docs
from coevolve.shared.envs.bfcl.tasks import MULTI_TURN_CATEGORIES, load_tasks
from coevolve.shared.llm import LLMResponse, RoleLLM, RoleSettings
from coevolve.shared.messages import Lineage, Task, TaskCandidate, ToolCall
from coevolve.shared.structured import RejectionCounter
from coevolve.shared.wording import template_request
from tests.services.judge.test_judge_checks import bfcl, turn, with_request

# multi_turn_base_138#t4 (MessageAPI, TradingBot): "Could you retract that specific
# message from their inbox, please?" -> delete_message
RETRACT = "multi_turn_base_138#t4"
# multi_turn_base_100#t0 (TradingBot): "I've got my eye on Nvidia ... its current stock
# price" -> get_stock_info(symbol='NVDA')
STOCK = "multi_turn_base_100#t0"

# what default runs accepted (7 of 9 accepted requests in a 30-minute run)
TEMPLATES = [
    "delete message: Delete the latest message sent to a receiver Details: receiver id 'USR005'.",
    "message login: User 'USR002' logged in successfully.",
    "Please remove my last message. Details: receiver id 'USR005'.",
    "receiver id 'USR005'; message 'Meeting at 10'.",
    "Delete the latest message sent to a receiver.",
    # a description copied as one sentence of several (a 0.5B abstractor, 2026-11-29)
    "View all historical messages sent by the current user. Then tell USR005 hello.",
    "Send a message. Receiver: USR005, Message: hello, Sender: USR002, Priority: high",
]


def with_targets(task: Task, targets: list[str], calls: list[ToolCall] | None = None) -> Task:
    lineage = msgspec.structs.replace(task.lineage, depth=1, target_functions=targets)
    task = msgspec.structs.replace(task, lineage=lineage)
    return task if calls is None else msgspec.structs.replace(task, ground_truth=[calls])


def message_api() -> tuple[list[str], list[str], list[str]]:
    docs = function_docs("MessageAPI")
    parameters = [p for doc in docs for p in doc.properties]
    return [d.name for d in docs], [d.summary for d in docs], parameters


@pytest.mark.parametrize("request_text", TEMPLATES)
def test_a_template_request_is_refused(request_text: str) -> None:
    names, descriptions, parameters = message_api()
    assert template_request(request_text, names, descriptions, parameters) is not None
    task = with_request(turn(RETRACT), request_text)
    result = check_not_template(task, trace_calls(task, bfcl))
    assert not result.passed
    assert result.reasons[0].startswith("request 0 is a template")
    failed = {r.name for r in semantic_checks(task, bfcl, backend="ngram") if not r.passed}
    assert "not_template" in failed


def test_why_a_template_is_refused() -> None:
    names, descriptions, parameters = message_api()
    reasons = [template_request(t, names, descriptions, parameters) for t in TEMPLATES]
    assert "'Details:'" in str(reasons[0]) and "'Details:'" in str(reasons[2])
    assert "name of message_login and a colon" in str(reasons[1])
    assert "list of argument values" in str(reasons[3])
    assert "copied from a description" in str(reasons[4])
    assert "a sentence copies a description" in str(reasons[5])
    assert "it labels its values" in str(reasons[6])


@pytest.mark.parametrize(
    "request_text",
    [
        "Could you retract that specific message from their inbox, please?",
        "Delete the latest message I sent to USR005, it had a typo.",
        "Send 'Meeting at 10; bring the slides' to my colleague USR005.",
        "Consider this: I want to log in as USR002 and read my messages.",
    ],
)
def test_a_sound_request_is_not_a_template(request_text: str) -> None:
    names, descriptions, parameters = message_api()
    assert template_request(request_text, names, descriptions, parameters) is None
    task = with_request(turn(RETRACT), request_text)
    assert check_not_template(task, trace_calls(task, bfcl)).passed


def test_no_bfcl_user_turn_is_a_template() -> None:
    """Calibration: every user turn of the four multi-turn categories (3,336, 200 of them
    empty) against the functions, descriptions and parameters of its entry's classes."""
    flagged = []
    count = 0
    for category in MULTI_TURN_CATEGORIES:
        for task in load_tasks(category):
            docs = [d for c in task.env_config["involved_classes"] for d in function_docs(c)]
            names = [d.name for d in docs]
            descriptions = [d.summary for d in docs]
            parameters = [p for d in docs for p in d.properties]
            for request in task.user_turns:
                count += 1
                if template_request(request, names, descriptions, parameters) is not None:
                    flagged.append((task.id, request))
    assert count > 3000
    assert flagged == []


# the brief's example says filter_stock_by_price; TradingBot's function is this one
FILTER = ToolCall(
    name="filter_stocks_by_price",
    arguments={"stocks": ["NVDA", "AAPL"], "min_price": 100.0, "max_price": 300.0},
)


def test_a_child_that_does_not_call_its_target_function_is_refused() -> None:
    task = with_targets(turn(STOCK), ["get_stock_info"], [FILTER])
    result = check_exercises_failure(task)
    assert not result.passed
    assert "get_stock_info" in result.reasons[0]
    assert "filter_stocks_by_price" in result.reasons[0]
    results = {r.name: r for r in semantic_checks(task, bfcl, backend="ngram")}
    assert not results["exercises_failure"].passed


def test_a_child_that_calls_its_target_function_passes() -> None:
    task = with_targets(turn(STOCK), ["get_stock_info", "place_order"])
    result = check_exercises_failure(task)
    assert result.passed and result.details["hit"] == ["get_stock_info"]
    both = with_targets(task, ["get_stock_info"], [FILTER, *turn(STOCK).ground_truth[0]])
    assert check_exercises_failure(both).passed


def test_a_task_without_targets_passes() -> None:
    task = turn(STOCK)
    assert task.lineage.target_functions == []
    assert check_exercises_failure(task).passed
    unguided = msgspec.structs.replace(task, ground_truth=[[FILTER]], lineage=Lineage())
    assert check_exercises_failure(unguided).passed


class NoLLM:
    name = "none"

    async def chat(self, messages: object, **_: object) -> LLMResponse:
        raise AssertionError("the LLM judge is off")

    async def aclose(self) -> None:
        return None


def judge(task: Task) -> Judged:
    llm = RoleLLM("judge", NoLLM(), RoleSettings(temperature=0.0))
    deps = JudgeDeps(llm, JudgeConfig(relevance_backend="ngram"), RejectionCounter())
    candidate = TaskCandidate(id=f"c-{task.id}", exploration_id="e", task=task)
    return anyio.run(judge_candidate, candidate, deps)


def test_the_judge_rejects_a_child_missing_its_target_and_accepts_one_hitting_it() -> None:
    missed = judge(with_targets(turn(STOCK), ["get_stock_info"], [FILTER]))
    assert missed.outcome == "rejected_by_checks"
    assert missed.verdict.criteria["exercises_failure"] is False
    assert any("get_stock_info" in reason for reason in missed.verdict.reasons)
    hit = judge(with_targets(turn(STOCK), ["get_stock_info"]))
    assert hit.outcome == "accepted", hit.verdict.reasons
    assert hit.verdict.criteria["exercises_failure"] is True
    assert hit.verdict.criteria["not_template"] is True


def test_the_judge_rejects_a_template_even_with_its_values_named() -> None:
    """The request names NVDA only in its Details list: other checks read it without that
    list, this one refuses it for having one."""
    request = "get stock info: Get the details of a stock. Details: symbol 'NVDA'."
    judged = judge(with_request(turn(STOCK), request))
    assert judged.outcome == "rejected_by_checks"
    assert judged.verdict.criteria["not_template"] is False
