"""The BFCL environment through its protocol, on real BFCL entries and API classes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl import BfclEnvironment, load_tasks
from coevolve.shared.envs.bfcl.environment import EpisodeNotStartedError
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.toolcalls import format_tool_calls
from tests.envs.conftest import first_task_with_class, task_by_id


def _call(name: str, **arguments: Any) -> str:
    return format_tool_calls([ToolCall(name=name, arguments=arguments)])


def play_ground_truth_through_step(env: BfclEnvironment, task: Task) -> float:
    """Answer every turn as an agent would: the turn's calls in one message, then text."""
    env.reset(task)
    for turn_calls in task.ground_truth:
        if turn_calls:
            result = env.step(format_tool_calls(turn_calls))
            assert not result.info["errors"], result.info["errors"]
        env.step("Done.")
    assert env.done
    return env.score()


def assert_failed(env: BfclEnvironment, error_type: str) -> None:
    """The episode scores 0, and BFCL's report says ``error_type``."""
    assert env.score() == 0.0
    assert env.last_report is not None
    assert env.last_report.error_type == error_type


def test_registry_makes_independent_bfcl_environments() -> None:
    first, second = make_environment("bfcl"), make_environment("bfcl")
    assert first is not second
    assert isinstance(first, Environment)
    assert first.name == "bfcl"


def test_reset_returns_the_first_user_turn_and_the_tools(base_tasks: list[Task]) -> None:
    task = base_tasks[0]
    env = BfclEnvironment()
    messages = env.reset(task)
    assert [m.role for m in messages] == ["user"]
    assert messages[0].content == task.user_turns[0]
    names = {tool["function"]["name"] for tool in env.tools()}
    assert {"cd", "mkdir", "mv", "post_tweet"} <= names
    assert all(tool["type"] == "function" for tool in env.tools())


def test_tool_calls_change_this_episodes_state(base_tasks: list[Task]) -> None:
    env = BfclEnvironment()
    env.reset(base_tasks[0])
    result = env.step(_call("cd", folder="document") + _call("mkdir", dir_name="temp"))
    assert [m.role for m in result.observations] == ["tool", "tool"]
    assert not result.done
    assert result.info["calls"] == ["cd", "mkdir"]
    assert result.info["call_strings"] == ["cd(folder='document')", "mkdir(dir_name='temp')"]
    listing = env.step(_call("ls"))
    assert "temp" in listing.observations[0].content
    assert env.turn == 0


def test_plain_text_moves_to_the_next_turn_and_the_last_one_ends(base_tasks: list[Task]) -> None:
    task = base_tasks[1]
    env = BfclEnvironment()
    env.reset(task)
    for turn in range(1, len(task.user_turns)):
        result = env.step("I have done that.")
        assert [m.role for m in result.observations] == ["user"]
        assert result.observations[0].content == task.user_turns[turn]
        assert result.info["turn_ended"] and env.turn == turn
    final = env.step("All done.")
    assert final.done and final.observations == []
    # no calls at all: BFCL's empty-turn failure
    assert_failed(env, "multi_turn:empty_turn_model_response")
    after = env.step("anything")
    assert after.done and after.info["errors"] == ["the episode is over"]


def test_malformed_and_invalid_calls_are_observations_not_exceptions(
    base_tasks: list[Task],
) -> None:
    env = BfclEnvironment()
    env.reset(base_tasks[0])
    result = env.step(
        "<tool_call>{broken</tool_call>"
        + _call("no_such_function")
        + _call("cd", folder=3)
        + _call("cd", directory="document")
        + _call("mkdir")
    )
    texts = [m.content for m in result.observations]
    assert len(texts) == 5 and all(t.startswith("Error:") for t in texts)
    assert "not valid JSON" in texts[0]
    assert "unknown function 'no_such_function'" in texts[1] and "Available functions" in texts[1]
    assert "must be a string, got integer" in texts[2]
    assert "unknown argument(s) 'directory'" in texts[3]
    assert "missing required argument(s): dir_name" in texts[4]
    assert result.info["calls"] == [] and len(result.info["errors"]) == 5
    assert env.turn == 0 and not result.done


def test_an_api_error_is_reported_but_not_an_exception(base_tasks: list[Task]) -> None:
    env = BfclEnvironment()
    env.reset(base_tasks[0])
    ok, observation = env.execute(ToolCall(name="cd", arguments={"folder": "nowhere"}))
    assert not ok
    assert "No such" in observation or "error" in observation.lower()


def test_per_turn_step_budget_force_terminates_with_score_zero(base_tasks: list[Task]) -> None:
    env = BfclEnvironment(max_steps_per_turn=3)
    env.reset(base_tasks[0])
    results = [env.step(_call("pwd")) for _ in range(4)]
    assert [r.done for r in results] == [False, False, False, True]
    assert "step budget" in results[-1].info["end_reason"]
    assert_failed(env, "multi_turn:force_terminated")


def test_episode_step_budget(base_tasks: list[Task]) -> None:
    env = BfclEnvironment(max_steps=2)
    env.reset(base_tasks[0])
    assert not env.step(_call("pwd")).done
    assert env.step(_call("pwd")).done
    assert env.score() == 0.0


def test_long_observations_are_clipped_for_the_agent(base_tasks: list[Task]) -> None:
    env = BfclEnvironment(max_observation_chars=10)
    env.reset(base_tasks[0])
    ok, observation = env.execute(ToolCall(name="ls", arguments={"a": True}))
    assert ok and "[truncated" in observation and observation.startswith(observation[:10])


def test_steps_before_reset_raise_a_clear_error() -> None:
    with pytest.raises(EpisodeNotStartedError):
        BfclEnvironment().step("hello")


def test_miss_func_reveals_held_out_functions_at_their_turn() -> None:
    task = next(t for t in load_tasks("multi_turn_miss_func") if t.env_config["missed_function"])
    reveal_turn, names = next(iter(task.env_config["missed_function"].items()))
    env = BfclEnvironment()
    env.reset(task)
    offered = {tool["function"]["name"] for tool in env.tools()}
    assert not set(names) & offered
    ok, observation = env.execute(ToolCall(name=names[0], arguments={}))
    assert not ok and f"unknown function '{names[0]}'" in observation
    last = None
    for _ in range(int(reveal_turn)):
        last = env.step("I cannot do that with these functions.")
    assert last is not None and env.turn == int(reveal_turn)
    assert last.observations[-1].content == DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
    assert set(names) <= {tool["function"]["name"] for tool in env.tools()}


@pytest.mark.parametrize(
    "category",
    ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"],
)
def test_ground_truth_played_through_step_scores_one(category: str) -> None:
    tasks = load_tasks(category)[::25]
    env = BfclEnvironment()
    scores = {task.id: play_ground_truth_through_step(env, task) for task in tasks}
    assert all(score == 1.0 for score in scores.values()), scores


def test_replay_reports_errors_and_state_change(base_tasks: list[Task]) -> None:
    task = base_tasks[0]
    env = BfclEnvironment()
    env.reset(task)
    replay = env.replay(task.ground_truth)
    assert replay.ok and replay.errors == [] and replay.state_changed
    assert len(replay.observations) == sum(len(turn) for turn in task.ground_truth)
    assert env.done and env.score() == 1.0

    env.reset(task)
    nothing = env.replay([[ToolCall(name="pwd")]])
    assert nothing.ok and not nothing.state_changed and not env.done

    env.reset(task)
    bad = env.replay([[ToolCall(name="rm", arguments={"file_name": "missing.txt"})]])
    assert not bad.ok and "rm" in bad.errors[0]


def test_replay_beyond_the_last_turn_is_an_error(base_tasks: list[Task]) -> None:
    task = base_tasks[0]
    env = BfclEnvironment()
    env.reset(task)
    replay = env.replay([*task.ground_truth, [ToolCall(name="pwd")]])
    assert not replay.ok and "no more turns" in replay.errors[-1]


# ------------------------------------------------------------------ isolation


def _mutable_ids(root: Any) -> set[int]:
    """ids of every mutable object reachable from ``root`` (containers and instances)."""
    seen: set[int] = set()
    found: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            found.add(id(obj))
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | set):
            found.add(id(obj))
            stack.extend(obj)
        elif isinstance(obj, tuple | frozenset):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            found.add(id(obj))
            stack.append(vars(obj))
    return found


def _instances_of(env: BfclEnvironment) -> dict[str, Any]:
    return env._instances  # the test inspects the episode's own objects on purpose


@pytest.mark.parametrize("category", ["multi_turn_base", "multi_turn_long_context"])
def test_two_episodes_of_one_entry_share_no_mutable_object(category: str) -> None:
    tasks = load_tasks(category)
    for class_name in ("GorillaFileSystem", "TravelAPI", "TradingBot", "MessageAPI"):
        task = first_task_with_class(tasks, class_name)
        first, second = BfclEnvironment(), BfclEnvironment()
        first.reset(task)
        second.reset(task)
        shared = _mutable_ids(_instances_of(first)) & _mutable_ids(_instances_of(second))
        assert not shared, f"{task.id}: {len(shared)} shared objects"


def test_a_change_in_one_episode_is_invisible_to_another(base_tasks: list[Task]) -> None:
    task = base_tasks[0]
    first, second = BfclEnvironment(), BfclEnvironment()
    first.reset(task)
    second.reset(task)
    first.step(_call("cd", folder="document") + _call("mkdir", dir_name="only_in_first"))
    second.step(_call("cd", folder="document"))
    assert "only_in_first" in first.step(_call("ls")).observations[0].content
    assert "only_in_first" not in second.step(_call("ls")).observations[0].content
    fresh = BfclEnvironment()
    fresh.reset(task)
    fresh.step(_call("cd", folder="document"))
    assert "only_in_first" not in fresh.step(_call("ls")).observations[0].content


def _threads(count: int, target: Any) -> Iterator[threading.Thread]:
    for index in range(count):
        yield threading.Thread(target=target, args=(index,))


def test_concurrent_episodes_of_one_entry_all_score_one(base_tasks: list[Task]) -> None:
    tasks = [task_by_id(base_tasks, f"multi_turn_base_{n}") for n in (0, 60, 110, 160)]
    expected_states = {}
    for task in tasks:
        env = BfclEnvironment()
        env.reset(task)
        env.replay(task.ground_truth)
        expected_states[task.id] = env.state()
    results: dict[tuple[str, int], tuple[float, Any]] = {}
    barrier = threading.Barrier(8)

    def run(index: int) -> None:
        task = tasks[index % len(tasks)]
        env = BfclEnvironment()
        env.reset(task)
        barrier.wait()
        for turn in task.ground_truth:
            env.replay([turn])
        results[(task.id, index)] = (env.score(), env.state())

    threads = list(_threads(8, run))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    for (task_id, _), (score, state) in results.items():
        assert score == 1.0
        assert state == expected_states[task_id]


def test_tasks_with_a_broken_config_are_refused_clearly(base_tasks: list[Task]) -> None:
    task = base_tasks[0]
    env = BfclEnvironment()
    with pytest.raises(ValueError, match="involved_classes"):
        env.reset(Task(id="t", environment="bfcl", user_turns=["hi"], env_config={}))
    with pytest.raises(ValueError, match="unknown BFCL API classes"):
        env.reset(
            Task(
                id="t",
                environment="bfcl",
                user_turns=["hi"],
                env_config={"involved_classes": ["NoSuchAPI"]},
            )
        )
    with pytest.raises(ValueError, match="not 'bfcl'"):
        env.reset(Task(id="t", environment="appworld", user_turns=["hi"]))
    unlabelled = Task(
        id="u",
        environment="bfcl",
        user_turns=task.user_turns,
        initial_state=task.initial_state,
        env_config=task.env_config,
    )
    env.reset(unlabelled)
    for _ in unlabelled.user_turns:
        env.step("ok")
    assert_failed(env, "task:ground_truth_mismatch")


def test_execute_counts_toward_the_step_budget(base_tasks: list[Task]) -> None:
    env = BfclEnvironment(max_steps=3)
    env.reset(base_tasks[0])
    for _ in range(3):
        env.execute(ToolCall(name="pwd"))
    assert env.done
    assert env.execute(ToolCall(name="pwd")) == (False, "Error: the episode is over")
