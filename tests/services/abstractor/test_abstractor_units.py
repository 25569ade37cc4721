"""``abstract``: one request asked per call unit, then the filters, over a real pool file,
the real BFCL environment and a remote LLM on loopback."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from coevolve.services.abstractor.handler import Abstraction
from coevolve.shared.messages import ToolCall
from tests.dataloop.dataloop_harness import (
    WellFormedBrain,
    filesystem_seed_tasks,
    logged_exploration,
)
from tests.services.abstractor.abstraction_harness import abstracted
from tests.support.fake_llm import RoleFakeLLM

pytestmark = pytest.mark.anyio


def folder(name: str) -> ToolCall:
    return ToolCall(name="mkdir", arguments={"dir_name": name})


async def abstracted_alpha(tmp_path: Path, requests: list[str]) -> tuple[Abstraction, RoleFakeLLM]:
    """The abstraction of one round that made folder alpha, the abstractor's LLM writing
    requests of the ``requests`` kinds in turn."""
    brain = WellFormedBrain(requests=requests)
    return await abstracted(tmp_path, brain, logged_exploration([[(folder("alpha"), True)]]))


async def test_each_unit_gets_a_request_and_the_filters_drop_the_bad_ones(tmp_path: Path) -> None:
    task = filesystem_seed_tasks(1)[0]
    kinds = ["good", "eval_leak", "duplicate", "malformed", "malformed"]
    brain = WellFormedBrain(requests=kinds, parent=task)
    # the leaked and the duplicated request name no value, so their units pass no value
    # (a request leaving out a value its calls pass is asked for again)
    ls, pwd = ToolCall(name="ls", arguments={}), ToolCall(name="pwd", arguments={})
    calls = [folder("alpha"), ls, pwd, folder("delta")]
    rounds = [[(call, True)] for call in calls]
    result, fake = await abstracted(tmp_path, brain, logged_exploration(rounds))

    # the malformed request is asked for once more, and is malformed again
    assert fake.calls == {"abstractor": 5} and result.drafts == 4
    [candidate] = result.candidates
    assert candidate.task.ground_truth == [[folder("alpha")]]
    assert "'alpha'" in candidate.task.user_turns[0]
    reasons = Counter(reason for reason, _ in result.dropped)
    assert reasons == {"eval_leak": 1, "near_duplicate": 1, "malformed_request": 1}


async def test_an_exploration_with_nothing_that_replays_asks_no_llm(tmp_path: Path) -> None:
    missing = ToolCall(name="cd", arguments={"folder": "no_such_folder"})
    result, fake = await abstracted(
        tmp_path, WellFormedBrain(), logged_exploration([[(missing, False)]])
    )
    assert not fake.calls and result.drafts == 0 and not result.candidates
    assert [reason for reason, _ in result.dropped] == ["no_calls"]


async def test_a_request_written_as_code_is_asked_for_again_with_the_reason(
    tmp_path: Path,
) -> None:
    result, fake = await abstracted_alpha(tmp_path, ["code", "good"])

    assert fake.calls == {"abstractor": 2} and not result.dropped
    [candidate] = result.candidates
    assert "mkdir(" not in candidate.task.user_turns[0]
    assert "'alpha'" in candidate.task.user_turns[0]


async def test_a_request_too_short_is_asked_for_again_opening_with_plain_words(
    tmp_path: Path,
) -> None:
    result, fake = await abstracted_alpha(tmp_path, ["malformed", "good"])
    patterns = [
        request["response_format"]["json_schema"]["schema"]["properties"]["request"]["pattern"]
        for role, request in fake.requests
        if role == "abstractor"
    ]
    assert len(patterns) == 2 and len(result.candidates) == 1
    assert not patterns[0].startswith("^[A-Za-z]")
    assert patterns[1].startswith("^" + "[A-Za-z][a-z]*[ ]" * 3)


async def test_a_unit_that_makes_the_parents_own_calls_is_dropped_unasked(
    tmp_path: Path,
) -> None:
    parent = filesystem_seed_tasks(1)[0]
    own = [(call, True) for call in parent.ground_truth[0]]
    result, fake = await abstracted(tmp_path, WellFormedBrain(), logged_exploration([own], parent))
    assert not fake.calls and not result.candidates
    assert [reason for reason, _ in result.dropped] == ["parent_calls"]


async def test_each_rewrite_is_asked_warmer(tmp_path: Path) -> None:
    result, fake = await abstracted_alpha(tmp_path, ["malformed", "malformed", "good"])
    assert [reason for reason, _ in result.dropped] == ["malformed_request"]
    temperatures = [request["temperature"] for role, request in fake.requests]
    assert len(temperatures) == 2  # rewrites=1 in these tests: dropped after the second
    assert temperatures[1] > temperatures[0]
