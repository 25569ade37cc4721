"""The attributor's steps, prompt, schema and answers (``shared/attribution``), without a
model: the schema must become a llama.cpp grammar, the answer one label per step."""

from __future__ import annotations

import json

import jsonschema
import pytest

from coevolve.shared.attribution import (
    attribution_messages,
    labels_fit,
    labels_schema,
    parse_labels,
    policy_steps,
    step_spans,
)
from coevolve.shared.messages import ChatMessage, Task, ToolCall
from coevolve.shared.structured import Rejection
from tests.support.messages import CD, NOTES_TASK, stepped_trajectory

TASK = NOTES_TASK
# a per-turn task's prompt: an earlier turn replayed, its assistant messages included
PROMPT = [
    ChatMessage(role="user", content="List the files."),
    ChatMessage(role="assistant", content="", tool_calls=[ToolCall(name="ls")]),
    ChatMessage(role="tool", content='{"current_directory_content": ["documents"]}'),
    ChatMessage(role="assistant", content="Done."),
    ChatMessage(role="user", content=TASK.user_turns[0]),
]
STEPS = [
    [
        ChatMessage(role="assistant", content="", tool_calls=[CD]),
        ChatMessage(role="tool", content='{"current_working_directory": "documents"}'),
    ],
    [ChatMessage(role="assistant", content="I could not create the file.")],
]


def answer(*verdicts: tuple[int, str]) -> str:
    return json.dumps({"labels": [{"step": s, "verdict": v} for s, v in verdicts]})


def test_the_schema_becomes_a_grammar_that_fixes_the_number_of_labels() -> None:
    """llama-cpp-python's server turns the schema into a GBNF grammar (and silently falls
    back to any JSON when it cannot): it must convert, with exactly N labels of GOOD/BAD."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    for steps in (1, 2, 3, 8, 16):
        grammar = json_schema_to_gbnf(json.dumps(labels_schema(steps)))
        rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines() if " ::= " in line)
        assert "root" in rules
        assert rules["labels"].count("labels-item") == steps, rules["labels"]
        assert '"\\"GOOD\\""' in grammar and '"\\"BAD\\""' in grammar


def test_the_schema_accepts_one_verdict_per_step_and_nothing_else() -> None:
    schema = labels_schema(2)
    jsonschema.validate(json.loads(answer((1, "GOOD"), (2, "BAD"))), schema)
    for wrong in (
        answer((1, "GOOD")),
        answer((1, "GOOD"), (2, "BAD"), (3, "BAD")),
        answer((1, "GOOD"), (2, "MAYBE")),
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(wrong), schema)
    with pytest.raises(ValueError):
        labels_schema(0)


def test_answers_become_plus_and_minus_one_in_step_order() -> None:
    assert parse_labels(answer((1, "GOOD"), (2, "BAD")), 2) == [1, -1]
    assert parse_labels(answer((2, "GOOD"), (1, "BAD")), 2) == [-1, 1]
    assert parse_labels("```json\n" + answer((1, "BAD")) + "\n```", 1) == [-1]


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (answer((1, "GOOD")), "wrong_count"),
        (answer((1, "GOOD"), (2, "BAD"), (3, "GOOD")), "wrong_count"),
        (answer((1, "GOOD"), (1, "BAD")), "wrong_steps"),
        (answer((0, "GOOD"), (1, "BAD")), "wrong_steps"),
        (answer((1, "GOOD"), (2, "OK")), "wrong_schema"),
        ('{"labels": [{"step": 1, "verdict": "GO', "truncated"),
        ("", "empty"),
    ],
)
def test_an_unusable_answer_is_a_rejection(text: str, kind: str) -> None:
    outcome = parse_labels(text, 2)
    assert isinstance(outcome, Rejection) and outcome.kind == kind, outcome


def test_the_steps_are_the_generated_assistant_messages_not_the_prompts() -> None:
    trajectory = stepped_trajectory("x", "t", PROMPT, STEPS, reward=0.4)
    assert step_spans(trajectory.loss_mask) == [(3, 5), (6, 8)]
    steps = policy_steps(trajectory)
    assert [s.action for s in steps] == [STEPS[0][0], STEPS[1][0]]
    assert [s.answers for s in steps] == [[STEPS[0][1]], []]
    assert step_spans([1, 1, 0, 1]) == [(0, 2), (3, 4)] and step_spans([0, 0]) == []


def test_labels_fit_only_with_one_per_step() -> None:
    assert labels_fit(stepped_trajectory("x", "t", PROMPT, STEPS, step_labels=[1, -1]))
    assert not labels_fit(stepped_trajectory("x", "t", PROMPT, STEPS, step_labels=[1]))
    assert not labels_fit(stepped_trajectory("x", "t", PROMPT, STEPS))


def test_the_prompt_numbers_the_steps_with_their_answers_reward_and_expected_calls() -> None:
    trajectory = stepped_trajectory("x", "t", PROMPT, STEPS, reward=0.4)
    system, user = attribution_messages(TASK, trajectory, policy_steps(trajectory))
    assert system["role"] == "system" and user["role"] == "user"
    text = user["content"]
    assert TASK.user_turns[0] in text
    assert 'Step 1: calls cd(folder="documents")' in text
    assert '-> result: {"current_working_directory": "documents"}' in text
    assert "Step 2: writes: I could not create the file." in text
    assert "Step 3" not in text and "ls(" not in text  # the prompt's turn is not a step
    assert "Final reward: 0.40" in text
    assert 'Turn 1: cd(folder="documents"); touch(file_name="notes.txt")' in text
    assert "exactly 2 entries" in text
    no_truth = Task(id="t", environment="bfcl", user_turns=TASK.user_turns)
    _, unlabelled = attribution_messages(no_truth, trajectory, policy_steps(trajectory))
    assert "Expected calls" not in unlabelled["content"]
