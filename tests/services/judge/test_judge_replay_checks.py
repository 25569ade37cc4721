"""The judge's automatic checks on real BFCL candidates: replay, effect, self-score."""

from __future__ import annotations

import msgspec

from coevolve.services.judge.replay import ReplayCheck, is_result, replay_candidate
from coevolve.shared.envs import make_environment
from coevolve.shared.messages import Task, ToolCall
from tests.dataloop.dataloop_harness import filesystem_seed_tasks


def candidate(turns: list[str], calls: list[list[ToolCall]]) -> Task:
    seed = filesystem_seed_tasks(1)[0]
    return msgspec.structs.replace(
        seed, id="candidate", user_turns=turns, ground_truth=calls, origin="synthesized"
    )


def bfcl() -> object:
    return make_environment("bfcl")


def test_a_sound_candidate_passes_every_check() -> None:
    task = candidate(
        ["Make a folder named drafts.", "Now list the folder contents."],
        [[ToolCall(name="mkdir", arguments={"dir_name": "drafts"})], [ToolCall(name="ls")]],
    )
    check = replay_candidate(task, bfcl)  # type: ignore[arg-type]
    assert check.passed, check.problems()
    assert check.criteria == {
        "replay_succeeded": True,
        "state_changed_or_result": True,
        "scores_itself": True,
    }
    assert check.state_changed and check.self_score == 1.0
    assert "drafts" in check.observations[1]


def test_a_failing_call_fails_the_replay_and_the_self_score() -> None:
    task = candidate(
        ["Go into the missing folder."],
        [[ToolCall(name="cd", arguments={"folder": "definitely_missing"})]],
    )
    check = replay_candidate(task, bfcl)  # type: ignore[arg-type]
    assert not check.passed
    assert check.criteria["replay_succeeded"] is False
    assert any(p.startswith("replay failed") for p in check.problems())


def test_a_replay_with_no_effect_and_no_result_is_rejected() -> None:
    # what a replay of calls that neither change state nor return anything looks like
    check = ReplayCheck(
        observations=["None", "{}"],
        errors=[],
        state_changed=False,
        returned_result=False,
        self_score=1.0,
    )
    assert not check.passed
    assert check.criteria["state_changed_or_result"] is False
    assert check.problems() == ["replay changed no state and returned no result"]


def test_a_call_that_does_not_exist_fails() -> None:
    task = candidate(["Do the impossible."], [[ToolCall(name="teleport", arguments={})]])
    check = replay_candidate(task, bfcl)  # type: ignore[arg-type]
    assert not check.passed and check.errors


def test_results_that_carry_nothing() -> None:
    assert not is_result("None") and not is_result(" {} ") and not is_result("")
    assert not is_result('{"error": "cd: no such folder"}')
    assert is_result('{"current_directory_content": ["a"]}')
