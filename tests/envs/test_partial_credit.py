"""Partial credit on real BFCL per-turn tasks: what the reward shaping pays for."""

from __future__ import annotations

import msgspec
import pytest

from coevolve.shared.envs.bfcl import BfclEnvironment
from coevolve.shared.envs.bfcl.instances import function_table
from coevolve.shared.envs.bfcl.scoring import EpisodeRecord, partial_credit
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.envs.bfcl.validation import ValidatedCall, validate_call
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.toolcalls import format_tool_calls


def tasks_with_calls(n: int) -> list[Task]:
    tasks = [t for t in suite_tasks("bfcl-turns-base", "train") if any(t.ground_truth)]
    return tasks[:n]


def validated(task: Task, calls: list[ToolCall]) -> list[ValidatedCall]:
    functions = function_table(list(task.env_config["involved_classes"]))
    return [validate_call(call, functions) for call in calls]


def record_of(task: Task, calls: list[ToolCall]) -> EpisodeRecord:
    return [[validated(task, calls)]]


def with_other_value(call: ToolCall) -> ToolCall | None:
    """The call with its first string argument changed, or None when it has none."""
    for name, value in call.arguments.items():
        if isinstance(value, str):
            return msgspec.structs.replace(
                call, arguments={**call.arguments, name: value + "_other"}
            )
    return None


@pytest.mark.parametrize("task", tasks_with_calls(12), ids=lambda t: t.id)
def test_credit_is_one_for_the_ground_truth_and_less_for_anything_else(task: Task) -> None:
    truth = task.ground_truth[0]
    assert partial_credit(task, record_of(task, truth)) == 1.0
    assert partial_credit(task, [[]]) == 0.0
    assert partial_credit(task, []) == 0.0
    # every call twice: half the calls are extra
    assert partial_credit(task, record_of(task, truth + truth)) == pytest.approx(0.5)
    # the first call dropped
    assert partial_credit(task, record_of(task, truth[1:])) == pytest.approx(
        (len(truth) - 1) / len(truth)
    )
    changed = with_other_value(truth[0])
    if changed is not None:
        credit = partial_credit(task, record_of(task, [changed, *truth[1:]]))
        assert credit == pytest.approx((len(truth) - 0.5) / len(truth))


def test_the_environment_reports_the_credit_of_what_the_episode_did() -> None:
    task = tasks_with_calls(1)[0]
    env = BfclEnvironment()
    env.reset(task)
    env.replay(task.ground_truth)
    assert env.score() == 1.0 and env.partial_credit() == 1.0
    fresh = BfclEnvironment()
    with pytest.raises(Exception, match="reset"):
        fresh.partial_credit()


def test_rollout_refuses_a_weight_that_would_pass_for_solved() -> None:
    from coevolve.services.rollout.config import RolloutConfig

    assert RolloutConfig().partial_credit == 0.4
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="partial_credit"):
            RolloutConfig(partial_credit=bad)


def test_a_refused_call_of_the_right_function_earns_half() -> None:
    task = tasks_with_calls(1)[0]
    truth = task.ground_truth[0]
    names = [call.name for call in truth]
    # every call refused (say, wrong arguments): half credit each
    assert partial_credit(task, [[]], [names]) == pytest.approx(0.5)
    # refused calls of functions the turn does not use earn nothing and cost
    assert partial_credit(task, record_of(task, truth), [["no_such_function"]]) == pytest.approx(
        len(truth) / (len(truth) + 1)
    )
    env = BfclEnvironment()
    env.reset(task)
    bad_call = ToolCall(name=names[0], arguments={"bogus": 1})
    env.step(format_tool_calls([bad_call]))
    assert env.partial_credit() == pytest.approx(0.5 / len(truth))
