"""The warm start teaches the format the agent acts in: one call per assistant message,
the call's real result before the next call, and no message the rollout cannot generate."""

from __future__ import annotations

import pytest

from coevolve.services.learner.config import WarmStartConfig
from coevolve.services.learner.sft import build_examples
from coevolve.services.rollout.config import RolloutConfig
from coevolve.shared.demonstrations import (
    CLOSING_TEXT,
    replayed_conversation,
    target_token_counts,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.messages import Task
from coevolve.shared.policy import LoadedPolicy
from coevolve.shared.toolcalls import parse_tool_calls


@pytest.fixture(scope="module")
def train_turns() -> list[Task]:
    return suite_tasks("bfcl-turns-base", "train")


def test_every_train_turn_is_one_call_per_message_within_the_rollout_budget(
    policy: LoadedPolicy, train_turns: list[Task]
) -> None:
    budget = RolloutConfig().max_new_tokens
    assert WarmStartConfig().max_target_tokens == budget
    multi_call_turns = 0
    for task in train_turns:
        env = make_environment("bfcl")
        try:
            conversation = replayed_conversation(task, env)
        finally:
            env.close()
        own = conversation.messages[conversation.context :]
        calls = [parse_tool_calls(m.content).calls for m in own if m.role == "assistant"]
        assert all(len(made) <= 1 for made in calls), task.id
        assert [c for made in calls for c in made] == task.ground_truth[0], task.id
        # a result follows every call before the next message of the agent
        for index, message in enumerate(own):
            if message.role == "assistant" and message.tool_calls:
                assert own[index + 1].role == "tool", task.id
        assert own[-1].content == CLOSING_TEXT
        assert max(target_token_counts(policy.tokenizer, conversation)) <= budget, task.id
        multi_call_turns += len(task.ground_truth[0]) > 1
    assert multi_call_turns > 100  # the case the format is for is common, not a corner


def test_a_later_call_sees_the_value_an_earlier_call_returned(train_turns: list[Task]) -> None:
    """Where a turn's second call uses a value only the first call's result holds, the
    result is in the context before the second call is made."""
    found = 0
    for task in train_turns:
        calls = task.ground_truth[0]
        if len(calls) < 2:
            continue
        env = make_environment("bfcl")
        try:
            conversation = replayed_conversation(task, env)
        finally:
            env.close()
        messages = conversation.messages
        first_call = next(
            i for i in range(conversation.context, len(messages)) if messages[i].tool_calls
        )
        result = messages[first_call + 1].content
        second = messages[first_call + 2]
        values = [str(v) for v in second.tool_calls[0].arguments.values()]
        prompt_before = " ".join(m.content for m in messages[: first_call + 1])
        if any(len(v) > 3 and v in result and v not in prompt_before for v in values):
            found += 1
    assert found >= 5


def test_tasks_with_a_message_over_the_budget_are_left_out_and_counted(
    policy: LoadedPolicy, train_turns: list[Task]
) -> None:
    tasks = train_turns[:6]
    examples, skipped, over = build_examples(policy, tasks, max_target_tokens=None)
    assert len({e.task_id for e in examples}) == 6 and skipped == over == 0
    examples, skipped, over = build_examples(policy, tasks, max_target_tokens=4)
    assert examples == [] and skipped == over == 6
