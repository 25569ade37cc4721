"""A task as an ideal agent would have lived it, and its tokens with assistant-only labels.

The warm start trains on these conversations and the held-out eval scores their
likelihood, so both use the format the agent acts in during a rollout: one tool call per
assistant message, the call's real result after it, then a short closing reply that ends
the turn. A later call thus reads the values an earlier call returned (a price, an id)
instead of stating them before the tool has answered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from coevolve.shared.envs.protocol import Environment
from coevolve.shared.messages import ChatMessage, Task
from coevolve.shared.policy import render_prompt_ids
from coevolve.shared.toolcalls import format_tool_calls

IGNORE_INDEX = -100
# The reply that ends a turn once its calls are done (plain text advances the episode);
# the same words the BFCL environment writes after an earlier turn's calls.
CLOSING_TEXT = "Done."


@dataclass
class Conversation:
    """A task as an ideal agent would have lived it; ``tools[i]`` is what message i saw."""

    task_id: str
    messages: list[ChatMessage]
    tools: list[list[dict[str, Any]] | None]
    # the first ``context`` messages are the conversation so far (a per-turn task's earlier
    # turns): in the prompt, not supervised
    context: int = 0


@dataclass
class SftExample:
    """One training sequence; ``labels`` is -100 except at assistant tokens."""

    task_id: str
    input_ids: list[int]
    labels: list[int]

    @property
    def supervised_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


class ReplayError(RuntimeError):
    """The task's ground truth did not run cleanly in its environment."""


def turn_messages(calls: list[Any]) -> list[ChatMessage]:
    """The assistant messages that answer one turn: each call alone, then the closing."""
    made = [
        ChatMessage(role="assistant", content=format_tool_calls([call]), tool_calls=[call])
        for call in calls
    ]
    return [*made, ChatMessage(role="assistant", content=CLOSING_TEXT)]


def conversation_without_observations(task: Task) -> Conversation:
    """User turns and ground-truth calls only (no environment at hand)."""
    messages: list[ChatMessage] = []
    for turn, user_text in enumerate(task.user_turns):
        messages.append(ChatMessage(role="user", content=user_text))
        calls = task.ground_truth[turn] if turn < len(task.ground_truth) else []
        messages.extend(turn_messages(calls))
    return Conversation(task.id, messages, [None] * len(messages))


def replayed_conversation(task: Task, env: Environment) -> Conversation:
    """Drive ``env`` with the ground truth one call per step, recording what the agent
    would have seen (the tool list before each message, each call's real result)."""
    messages = list(env.reset(task))
    context = len(messages)
    tools: list[list[dict[str, Any]] | None] = [None] * len(messages)
    for turn in range(len(task.user_turns)):
        calls = task.ground_truth[turn] if turn < len(task.ground_truth) else []
        for reply in turn_messages(calls):
            current_tools = env.tools()
            result = env.step(reply.content)
            errors = result.info.get("errors") or []
            if errors:
                raise ReplayError(f"task {task.id} turn {turn}: {errors[0]}")
            messages.append(reply)
            tools.append(current_tools)
            messages.extend(result.observations)
            tools.extend([None] * len(result.observations))
            if result.done:
                return Conversation(task.id, messages, tools, context)
    return Conversation(task.id, messages, tools, context)


def target_token_counts(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation
) -> list[int]:
    """Tokens each supervised assistant message takes to generate (its end token included)."""
    return [
        len(tokenizer(message.content, add_special_tokens=False)["input_ids"]) + 1
        for index, message in enumerate(conversation.messages)
        if message.role == "assistant" and index >= conversation.context
    ]


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    *,
    supervise_closing: bool = True,
) -> list[SftExample]:
    """Token ids with assistant-only labels, one sequence per conversation when possible.

    Assistant message i is supervised as its text followed by the end-of-turn token, after
    the prompt ``render_prompt_ids(messages[:i])``. While each prompt extends the previous
    sequence (the usual case) everything stays in one sequence; when it does not (the tool
    list changed mid-episode) a new sequence starts from that prompt. Without
    ``supervise_closing`` the closing replies stay in the sequence unlabelled (only the
    calls are scored, as the held-out eval's log-likelihood wants).
    """
    end_of_turn = tokenizer.eos_token_id
    if end_of_turn is None:
        raise ValueError("the tokenizer has no end-of-turn (eos) token")
    examples: list[SftExample] = []
    ids: list[int] = []
    labels: list[int] = []
    for index, message in enumerate(conversation.messages):
        if message.role != "assistant" or index < conversation.context:
            continue
        prompt = render_prompt_ids(
            tokenizer, conversation.messages[:index], conversation.tools[index]
        )
        if prompt[: len(ids)] != ids:
            examples.append(SftExample(conversation.task_id, ids, labels))
            ids, labels = [], []
        labels = labels + [IGNORE_INDEX] * (len(prompt) - len(ids))
        ids = list(prompt)
        target = tokenizer(message.content, add_special_tokens=False)["input_ids"] + [end_of_turn]
        ids += target
        supervised = supervise_closing or bool(message.tool_calls)
        labels += target if supervised else [IGNORE_INDEX] * len(target)
    if ids:
        examples.append(SftExample(conversation.task_id, ids, labels))
    return [e for e in examples if e.supervised_tokens > 0]
