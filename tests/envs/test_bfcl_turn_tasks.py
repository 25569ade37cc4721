"""Per-turn BFCL tasks: built from entries, reset by replaying earlier turns, scored on one turn."""

from __future__ import annotations

import collections
import json

import msgspec
import pytest
from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
from typer.testing import CliRunner

from coevolve.services.pool_store.handler import seed_tasks_for
from coevolve.shared.config import ConfigError
from coevolve.shared.envs import bfcl
from coevolve.shared.envs.bfcl.environment import PRIOR_TURN_UNABLE
from coevolve.shared.envs.rendering import configure_tool_rendering
from coevolve.shared.evaluation import ground_truth_player, run_suite
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.toolcalls import format_tool_calls
from tests.envs.test_evaluation import _cli

CATEGORIES = ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param"]


def _wire(task: Task) -> Task:
    """The task as a rollout worker gets it: through msgpack, as on the bus."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(task), type=Task)


def _names(env: bfcl.BfclEnvironment) -> set[str]:
    return {tool["function"]["name"] for tool in env.tools()}


def _answer(env: bfcl.BfclEnvironment, task: Task, calls: list[ToolCall]) -> float:
    env.reset(task)
    if calls:
        env.step(format_tool_calls(calls))
    result = env.step("Done.")
    assert result.done
    return env.score()


def test_every_turn_with_ground_truth_becomes_a_task() -> None:
    entries = bfcl.load_tasks("multi_turn_base")
    turns = [turn for entry in entries for turn in bfcl.turn_tasks(entry)]
    assert len(turns) == sum(1 for e in entries for calls in e.ground_truth if calls)
    entry = entries[0]
    for turn in bfcl.turn_tasks(entry):
        k = turn.env_config["turn"]
        assert turn.id == f"{entry.id}#t{k}" and bfcl.grain_of(turn) == "turn"
        assert turn.user_turns == [entry.user_turns[k]]
        assert turn.ground_truth == [entry.ground_truth[k]]
        assert turn.env_config["prior_turns"] == entry.user_turns[:k]
        assert len(turn.env_config["prior_ground_truth"]) == k
        assert turn.source_entry == entry.id and turn.initial_state == entry.initial_state
    assert bfcl.grain_of(entry) == "entry" and "grain" not in entry.env_config


def test_turn_tasks_fall_on_their_entrys_side_of_the_split() -> None:
    turns = bfcl.suite_tasks("bfcl-turns-base", "all")
    assert all(bfcl.split_of(t.id) == bfcl.split_of(t.source_entry or "") for t in turns)
    for split in ("train", "eval"):
        entries = bfcl.suite_tasks("bfcl-multi-turn-base", split)
        expected = [turn.id for entry in entries for turn in bfcl.turn_tasks(entry)]
        assert [t.id for t in bfcl.suite_tasks("bfcl-turns-base", split)] == expected
    train, evaluation = bfcl.split_tasks(turns)
    assert {t.source_entry for t in train}.isdisjoint({t.source_entry for t in evaluation})


@pytest.mark.parametrize("category", CATEGORIES)
def test_reset_reaches_the_state_of_replaying_the_earlier_turns(category: str) -> None:
    entry = next(t for t in bfcl.load_tasks(category)[3:] if len(t.user_turns) >= 4)
    for turn in bfcl.turn_tasks(entry):
        k = turn.env_config["turn"]
        reference = bfcl.BfclEnvironment()
        reference.reset(entry)
        replayed = reference.replay(entry.ground_truth[:k])
        env = bfcl.BfclEnvironment()
        messages = env.reset(_wire(turn))
        assert env.state() == reference.state()
        assert env.turn == reference.turn == k
        assert _names(env) == _names(reference)
        # the conversation so far: earlier user turns, ground-truth calls, observations
        users = [m.content for m in messages if m.role == "user"]
        expected = [u or DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC for u in entry.user_turns]
        assert users == expected[: k + 1] and messages[-1].role == "user"
        calls = [c for m in messages if m.role == "assistant" for c in m.tool_calls]
        assert calls == [c for turn_calls in entry.ground_truth[:k] for c in turn_calls]
        assert [m.content for m in messages if m.role == "tool"] == replayed.observations


@pytest.mark.parametrize("category", [*CATEGORIES, "multi_turn_long_context"])
def test_ground_truth_of_a_turn_scores_one(category: str) -> None:
    tasks = [turn for entry in bfcl.load_tasks(category)[::40] for turn in bfcl.turn_tasks(entry)]
    assert tasks
    for task in tasks:
        if task.source_entry and task.source_entry.endswith(("_173", "miss_func_49")):
            continue  # ground-truth defects, listed in docs/bfcl_eval_results.md
        assert _answer(bfcl.BfclEnvironment(), task, task.ground_truth[0]) == 1.0, task.id


def test_a_wrong_call_or_no_call_scores_zero() -> None:
    tasks = [
        turn
        for entry in bfcl.load_tasks("multi_turn_base")[:30]
        if "GorillaFileSystem" in entry.env_config["involved_classes"]
        for turn in bfcl.turn_tasks(entry)[1:2]
    ]
    assert len(tasks) >= 5
    wrong = [ToolCall(name="mkdir", arguments={"dir_name": "not_what_was_asked"})]
    for task in tasks:
        env = bfcl.BfclEnvironment()
        assert _answer(env, task, wrong) == 0.0
        assert env.last_report is not None
        assert env.last_report.error_type == "multi_turn:instance_state_mismatch"
        assert f"turn {task.env_config['turn']}" in env.last_report.message
        assert _answer(env, task, []) == 0.0
        assert env.last_report.error_type == "multi_turn:empty_turn_model_response"


def test_miss_func_turns_carry_the_functions_of_their_turn() -> None:
    entry = next(t for t in bfcl.load_tasks("multi_turn_miss_func") if t.id.endswith("_0"))
    [(reveal, hidden)] = entry.env_config["missed_function"].items()
    turns = {turn.env_config["turn"]: turn for turn in bfcl.turn_tasks(entry)}
    # the turn that asks for a missing function has an empty ground truth: not a task
    assert int(reveal) - 1 not in turns and not entry.ground_truth[int(reveal) - 1]
    for k, turn in turns.items():
        env = bfcl.BfclEnvironment()
        messages = env.reset(turn)
        visible = set(hidden) <= _names(env)
        assert visible == (k >= int(reveal)), (k, hidden)
        if k == int(reveal):
            assert messages[-1].content == DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        if k > int(reveal):
            assert any(m.content == PRIOR_TURN_UNABLE for m in messages)
        assert _answer(env, turn, turn.ground_truth[0]) == 1.0


def test_seed_pool_mixes_turns_and_entries_by_the_configured_shares() -> None:
    train_ids = {t.id for t in bfcl.seed_tasks()}
    for grains, turns_share in (
        (None, 1.0),
        ({"turns": 0.8, "entries": 0.2}, 0.8),
        ({"turns": 1, "entries": 1}, 0.5),
        ({"turns": 0.3, "entries": 0.7}, 0.3),
    ):
        pool = bfcl.seed_pool(grains)
        counts = collections.Counter(bfcl.grain_of(t) for t in pool)
        assert counts["turn"] / len(pool) == pytest.approx(turns_share, abs=0.01)
        assert all(t.origin == "seed" for t in pool)
        assert {t.source_entry or t.id for t in pool} <= train_ids
        assert [t.id for t in bfcl.seed_pool(grains)] == [t.id for t in pool]
    assert all(bfcl.grain_of(t) == "entry" for t in bfcl.seed_pool({"entries": 1.0}))
    from_actor = seed_tasks_for("bfcl", {"turns": 1.0, "entries": 0.0})
    assert [t.id for t in from_actor] == [t.id for t in bfcl.seed_pool()]
    with pytest.raises(ConfigError, match="seed_grains"):
        seed_tasks_for("bfcl", {"turn": 1.0})


def test_eval_results_record_the_tool_rendering() -> None:
    tasks = bfcl.suite_tasks("bfcl-turns-base", "eval")[:4]
    play = ground_truth_player(bfcl.BfclEnvironment)
    for rendering in ("full", "compact"):
        configure_tool_rendering(rendering)
        report = run_suite(
            tasks, play, suite="bfcl-turns-base", split="eval", policy="gt", progress=False
        )
        assert report.summary()["tool_rendering"] == rendering
        assert f"tools={rendering}" in report.describe()
    for option, expected in (([], "compact"), (["--tool-rendering", "full"], "full")):
        result = CliRunner().invoke(
            _cli(),
            [
                "--suite",
                "bfcl-turns-base",
                "--limit",
                "5",
                "--policy",
                "ground-truth",
                "--json",
                *option,
            ],
        )
        assert result.exit_code == 0, result.output
        report_json = json.loads(result.stdout.strip().splitlines()[-1])
        assert report_json["tool_rendering"] == expected
        assert report_json["n"] == 5 and report_json["accuracy"] == 1.0
    bad = CliRunner().invoke(_cli(), ["--tool-rendering", "terse", "--policy", "ground-truth"])
    assert bad.exit_code != 0
