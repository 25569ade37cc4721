"""The judge's pipeline: the semantic checks reject a corrupted candidate, for the right
reason, before the LLM is asked; a sound one reaches the LLM."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from coevolve.services.judge.checks import SEMANTIC_CRITERIA
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import JudgeDeps, judge_candidate
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.llm import LLMResponse, RoleLLM, RoleSettings
from coevolve.shared.messages import Task, TaskCandidate, ToolCall
from coevolve.shared.structured import RejectionCounter

ACCEPT = (
    '{"criteria": {"api_matching": true, "parameter_usage": true, "logical_flow": true, '
    '"final_result": true, "no_failed_or_skipped_steps": true}, "accept": true, '
    '"reason": "The calls complete the request."}'
)


class CountingJudge:
    """An LLM endpoint that accepts everything and counts how often it was asked."""

    name = "counting"

    def __init__(self) -> None:
        self.asked = 0

    async def chat(self, messages: Any, **_: Any) -> LLMResponse:
        self.asked += 1
        return LLMResponse(text=ACCEPT, finish_reason="stop")

    async def aclose(self) -> None:
        return None


def train_turn(task_id: str) -> Task:
    return next(t for t in suite_tasks("bfcl-turns-base", "train") if t.id == task_id)


def judge(task: Task, **config: Any) -> tuple[Any, int]:
    endpoint = CountingJudge()
    llm = RoleLLM("judge", endpoint, RoleSettings(temperature=0.0))
    deps = JudgeDeps(llm, JudgeConfig(relevance_backend="ngram", **config), RejectionCounter())
    candidate = TaskCandidate(id=f"c-{task.id}", exploration_id="e", task=task)
    judged = anyio.run(judge_candidate, candidate, deps)
    return judged, endpoint.asked


def test_a_sound_candidate_passes_the_checks_and_reaches_the_llm() -> None:
    judged, asked = judge(train_turn("multi_turn_base_2#t0"), llm_judge=True)
    assert judged.outcome == "accepted" and asked == 1
    for name in SEMANTIC_CRITERIA:
        assert judged.verdict.criteria[name] is True


def test_a_wrong_argument_is_rejected_by_the_checks_without_asking_the_llm() -> None:
    # "I've got my eye on Nvidia. I'm keen to know its current stock price" -> NVDA
    task = train_turn("multi_turn_base_100#t0")
    tesla = ToolCall(name="get_stock_info", arguments={"symbol": "TSLA"})
    wrong = msgspec.structs.replace(task, ground_truth=[[tesla]])
    judged, asked = judge(wrong)
    assert asked == 0
    assert judged.outcome == "rejected_by_checks" and not judged.verdict.accepted
    assert judged.verdict.criteria["replay_succeeded"] is True  # the call itself works
    assert judged.verdict.criteria["names_arguments"] is False
    assert any("get_stock_info: 'TSLA'" in reason for reason in judged.verdict.reasons)


def test_a_redundant_call_is_rejected_naming_it() -> None:
    task = train_turn("multi_turn_base_62#t1")  # "verify that all the doors ... are locked"
    (lock,) = task.ground_truth[0]
    redundant = msgspec.structs.replace(task, ground_truth=[[lock, lock]])
    judged, asked = judge(redundant)
    assert asked == 0 and judged.outcome == "rejected_by_checks"
    assert judged.verdict.criteria["minimal"] is False
    assert any(
        r.startswith("redundant call: turn 1 call 1 lockDoors(") for r in judged.verdict.reasons
    )
    # with minimality switched off the same candidate goes on to the LLM
    judged, asked = judge(redundant, minimality=False, llm_judge=True)
    assert asked == 1 and "minimal" not in judged.verdict.criteria


def test_without_the_llm_judge_the_checks_decide() -> None:
    judged, asked = judge(train_turn("multi_turn_base_2#t0"), llm_judge=False)
    assert asked == 0 and judged.outcome == "accepted" and judged.verdict.accepted
    assert judged.verdict.reasons == [] and judged.verdict.criteria["minimal"] is True


def test_config_switches_default_on_and_refuses_unknown_keys() -> None:
    config = JudgeConfig()
    assert config.minimality and config.relevance and not config.round_trip
    assert not config.llm_judge  # the 0.5B judge rejected every sound turn (docs/judge.md)
    decoded = msgspec.convert({"relevance": False}, JudgeConfig)
    assert decoded.relevance is False
    try:
        msgspec.convert({"relevanse": False}, JudgeConfig)
    except msgspec.ValidationError:
        pass
    else:
        raise AssertionError("an unknown key was accepted")
