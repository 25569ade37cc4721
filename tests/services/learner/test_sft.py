"""SFT warm start on real BFCL tasks: assistant-only labels, replayed observations, training."""

from __future__ import annotations

import pytest
import torch

from coevolve.services.learner.memory import saved_for_backward
from coevolve.services.learner.sft import (
    accumulate_sft_gradients,
    build_examples,
    truncate,
    warm_start,
)
from coevolve.shared.demonstrations import (
    CLOSING_TEXT,
    IGNORE_INDEX,
    SftExample,
    conversation_without_observations,
    replayed_conversation,
    tokenize_conversation,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import Task
from coevolve.shared.policy import LoadedPolicy, render_prompt_ids
from coevolve.shared.toolcalls import format_tool_calls, parse_tool_calls

# long enough to hold the first turn's reply; short enough to train in seconds on a CPU
MAX_LEN = 136


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return seed_tasks()[:2]


def supervised_spans(labels: list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    inside = False
    for label in labels:
        if label == IGNORE_INDEX:
            inside = False
            continue
        if not inside:
            spans.append([])
            inside = True
        spans[-1].append(label)
    return spans


def test_replayed_conversation_has_real_observations(tasks: list[Task]) -> None:
    task = tasks[0]
    env = make_environment("bfcl")
    conversation = replayed_conversation(task, env)
    env.close()
    roles = [m.role for m in conversation.messages]
    assert roles[0] == "user" and roles.count("user") == len(task.user_turns)
    assistant = [m for m in conversation.messages if m.role == "assistant"]
    call_messages = [m for m in assistant if m.content != CLOSING_TEXT]
    # one call per message, in the ground truth's order
    assert [parse_tool_calls(m.content).calls for m in call_messages] == [
        [call] for calls in task.ground_truth for call in calls
    ]
    tool_messages = [m for m in conversation.messages if m.role == "tool"]
    assert len(tool_messages) == sum(len(calls) for calls in task.ground_truth)
    assert all(m.content and not m.content.startswith("Error") for m in tool_messages)
    # each assistant message saw the environment's tool list
    seen = [t for m, t in zip(conversation.messages, conversation.tools, strict=True) if t]
    assert len(seen) == len(assistant) and seen[0] == make_tools(task)


def make_tools(task: Task) -> list[dict[str, object]]:
    env = make_environment("bfcl")
    env.reset(task)
    tools = env.tools()
    env.close()
    return tools


def test_labels_cover_assistant_tokens_only(policy: LoadedPolicy, tasks: list[Task]) -> None:
    tokenizer = policy.tokenizer
    env = make_environment("bfcl")
    conversation = replayed_conversation(tasks[0], env)
    env.close()
    [example] = tokenize_conversation(tokenizer, conversation)
    assert len(example.labels) == len(example.input_ids)

    # supervised positions carry their own token as label; the rest is -100
    for token, label in zip(example.input_ids, example.labels, strict=True):
        assert label in (IGNORE_INDEX, token)
    assistant = [m for m in conversation.messages if m.role == "assistant"]
    spans = supervised_spans(example.labels)
    assert len(spans) == len(assistant)
    for span, message in zip(spans, assistant, strict=True):
        assert span[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(span[:-1]) == message.content

    # the unsupervised part is exactly the prompt the rollout renders before the last reply
    last = max(i for i, m in enumerate(conversation.messages) if m.role == "assistant")
    prompt = render_prompt_ids(tokenizer, conversation.messages[:last], conversation.tools[last])
    assert example.input_ids[: len(prompt)] == prompt
    assert all(label == IGNORE_INDEX for label in example.labels[len(prompt) - 1 : len(prompt)])
    observation = next(m.content for m in conversation.messages if m.role == "tool")
    supervised_text = tokenizer.decode([t for s in spans for t in s])
    assert observation not in supervised_text
    assert tasks[0].user_turns[0] not in supervised_text


def test_without_an_environment_the_calls_are_still_supervised(
    policy: LoadedPolicy, tasks: list[Task]
) -> None:
    conversation = conversation_without_observations(tasks[0])
    [example] = tokenize_conversation(policy.tokenizer, conversation)
    spans = supervised_spans(example.labels)
    expected = [
        text
        for calls in tasks[0].ground_truth
        for text in [*(format_tool_calls([call]) for call in calls), CLOSING_TEXT]
    ]
    assert [policy.tokenizer.decode(s[:-1]) for s in spans] == expected


def test_warm_start_trains_the_adapter_on_assistant_tokens(
    policy: LoadedPolicy, tasks: list[Task]
) -> None:
    base_weight = policy.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    base_before = base_weight.detach().clone()
    adapters_before = [p.detach().clone() for p in policy.model.parameters() if p.requires_grad]
    examples, _, _ = build_examples(policy, tasks, replay=False)
    seen: list[tuple[int, int, float]] = []

    report = warm_start(
        policy,
        tasks,
        epochs=2,
        lr=2e-3,
        batch_size=2,
        max_len=MAX_LEN,
        progress=lambda step, total, loss: seen.append((step, total, loss)),
        replay=False,
    )

    assert report.examples == 2 and report.skipped_tasks == 0 and report.steps == 2
    assert report.truncated_examples == sum(1 for e in examples if len(e.input_ids) > MAX_LEN)
    assert report.supervised_tokens == sum(
        sum(1 for label in e.labels[:MAX_LEN] if label != IGNORE_INDEX) for e in examples
    )
    assert [s[:2] for s in seen] == [(1, 2), (2, 2)]
    assert report.losses[-1] < report.losses[0]
    assert torch.equal(base_weight, base_before)
    adapters_after = [p for p in policy.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(adapters_before, adapters_after, strict=True))


def test_a_few_tasks_get_more_epochs_to_reach_the_minimum_steps(
    policy: LoadedPolicy, tasks: list[Task]
) -> None:
    report = warm_start(
        policy, tasks, epochs=2, batch_size=2, max_len=MAX_LEN, replay=False, min_steps=3
    )

    assert report.examples == 2
    assert (report.epochs, report.steps) == (3, 3)


def test_over_the_activation_budget_examples_run_checkpointed_with_the_same_gradient(
    policy: LoadedPolicy, tasks: list[Task]
) -> None:
    examples, _, _ = build_examples(policy, tasks, replay=False)
    examples = [truncate(e, MAX_LEN) for e in examples]
    normalizer = sum(e.supervised_tokens for e in examples)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    # LoRA B starts at zero, so A gets no gradient: give B a value first
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.01)
    policy.model.train()  # checkpointing applies in training mode only
    for module in policy.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # batched and one-at-a-time runs would draw different masks

    def gradient(activation_tokens: int | None) -> tuple[torch.Tensor, float, int]:
        with saved_for_backward() as saved:
            loss = accumulate_sft_gradients(
                policy.model,
                examples,
                0,
                torch.device("cpu"),
                normalizer,
                activation_tokens=activation_tokens,
            )
        flat = torch.cat([p.grad.flatten() for p in trainable if p.grad is not None])
        for p in trainable:
            p.grad = None
        return flat, loss, saved[0]

    stored, stored_loss, stored_bytes = gradient(None)
    checkpointed, checkpointed_loss, checkpointed_bytes = gradient(1)
    assert checkpointed_bytes < stored_bytes / 3  # the layers' activations were not kept
    assert not policy.model.get_base_model().is_activation_checkpointing
    assert stored.abs().sum() > 0
    assert checkpointed_loss == pytest.approx(stored_loss, rel=1e-4)
    assert float((stored - checkpointed).norm() / stored.norm()) < 1e-4


def test_the_activation_budget_counts_the_padding_of_a_micro_batch(policy: LoadedPolicy) -> None:
    """A long and a short example together fit the budget by their own lengths (240 of
    240), but padded to the longest they hold 400 tokens: they run checkpointed."""
    long, short = 200, 40

    def example(length: int, first: int) -> SftExample:
        ids = [first + i for i in range(length)]
        return SftExample("t", ids, [IGNORE_INDEX] * (length - 8) + ids[-8:])

    examples = [example(long, 500), example(short, 900)]  # no shared prompt
    policy.model.train()

    def saved_bytes(activation_tokens: int | None) -> int:
        with saved_for_backward() as saved:
            accumulate_sft_gradients(
                policy.model,
                examples,
                0,
                torch.device("cpu"),
                16.0,
                activation_tokens=activation_tokens,
            )
        for parameter in policy.model.parameters():
            parameter.grad = None
        return saved[0]

    assert saved_bytes(long + short) < saved_bytes(None) / 3
    assert saved_bytes(2 * long) > saved_bytes(long + short) * 3  # fits padded: stored
