"""The judge's LLM stages on the real local server (Qwen2.5-Coder-0.5B, llama.cpp)."""

from __future__ import annotations

import asyncio

import msgspec

from coevolve.services.judge.checks import CheckResult
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import Judged, JudgeDeps, judge_candidate
from coevolve.services.judge.roundtrip import round_trip
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.llm import LlamaServer, OpenAIBackend, RoleLLM, role_settings
from coevolve.shared.llm.roles import local_endpoint
from coevolve.shared.messages import Task, TaskCandidate
from coevolve.shared.structured import RejectionCounter


def judge_llm(server: LlamaServer) -> RoleLLM:
    settings = role_settings({"default": {"temperature": 0.0}})["judge"]
    endpoint = local_endpoint(settings, server.base_url, server.api_key, server.alias)
    return RoleLLM("judge", OpenAIBackend(endpoint), settings)


def stock_turn() -> Task:
    # "I've got my eye on Nvidia. I'm keen to know its current stock price" -> NVDA
    return next(
        t for t in suite_tasks("bfcl-turns-base", "train") if t.id == "multi_turn_base_100#t0"
    )


def test_the_round_trip_solves_from_the_request_and_scores_against_the_calls(
    llama_server: LlamaServer,
) -> None:
    async def go() -> CheckResult:
        llm = judge_llm(llama_server)
        try:
            return await round_trip(llm, stock_turn(), lambda: make_environment("bfcl"))
        finally:
            await llm.client.aclose()

    result = asyncio.run(go())
    assert result.name == "round_trip"
    details = result.details
    assert details["calls"] >= 1  # the grammar-constrained plan always parses
    assert result.passed == (details["score"] >= 1.0)


def test_with_the_round_trip_on_every_stage_leaves_its_criterion(
    llama_server: LlamaServer,
) -> None:
    task = stock_turn()

    async def go() -> Judged:
        llm = judge_llm(llama_server)
        config = JudgeConfig(relevance_backend="ngram", round_trip=True)
        deps = JudgeDeps(llm, config, RejectionCounter())
        try:
            candidate = TaskCandidate(id="c-llm", exploration_id="e", task=task)
            return await judge_candidate(candidate, deps)
        finally:
            await llm.client.aclose()

    judged = asyncio.run(go())
    criteria = judged.verdict.criteria
    assert criteria["names_arguments"] and criteria["minimal"] and "round_trip" in criteria
    if criteria["round_trip"]:
        assert "api_matching" in criteria  # the LLM judge was asked after it
    else:
        assert judged.outcome == "rejected_by_round_trip"
        assert "api_matching" not in criteria
    assert msgspec.json.encode(judged.verdict)
