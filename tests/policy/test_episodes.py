"""Episodes in the real BFCL environment with the real SmolLM2 policy."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.messages import Task, Trajectory
from coevolve.shared.policy import (
    Generation,
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    encode_text,
    render_text,
)
from coevolve.shared.toolcalls import format_tool_calls

TASK_ID = "multi_turn_base_100"  # TradingBot only, two turns: the shortest prompt


@pytest.fixture(scope="module")
def task() -> Task:
    return next(t for t in seed_tasks() if t.id == TASK_ID)


def bfcl() -> Any:
    return make_environment("bfcl")


def check_token_bookkeeping(trajectory: Trajectory) -> None:
    n = len(trajectory.token_ids)
    assert len(trajectory.loss_mask) == n == len(trajectory.logprobs)
    assert set(trajectory.loss_mask) <= {0, 1}
    for mask, logprob in zip(trajectory.loss_mask, trajectory.logprobs, strict=True):
        assert (logprob == 0.0) if mask == 0 else (logprob < 0.0 or logprob == 0.0)
    assert trajectory.loss_mask[0] == 0 and trajectory.loss_mask[-1] == 1


class ScriptedPolicy:
    """Says fixed assistant texts through the real tokenizer (a test double for the model).

    Its log-probs are 0.0: this double checks episode and token bookkeeping only; the
    real model's log-probs are checked in ``test_real_policy_group``.
    """

    def __init__(self, engine: TransformersEngine, texts: list[str], tokenizer: Any = None) -> None:
        self.engine = engine
        self.texts = list(texts)
        self._tokenizer = tokenizer or engine.tokenizer
        self.policy_version = 7
        self.prompts: list[list[int]] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def load_weights(self, blob: bytes, version: int) -> None:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        assert len(prompts) == 1
        self.prompts.append(list(prompts[0]))
        text = self.texts.pop(0)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = [*encode_text(self.tokenizer, text), end]
        return [Generation(text, prompts[0], ids, [0.0] * len(ids), [1.0] * len(ids), "stop")]


def test_ground_truth_script_scores_one_with_consistent_tokens(
    engine: TransformersEngine, task: Task
) -> None:
    texts = []
    for calls in task.ground_truth:
        texts += [format_tool_calls(calls), "Done."]
    scripted = ScriptedPolicy(engine, texts)
    trajectory = run_group(scripted, bfcl, task, 1, SamplingParams(), max_steps=10)[0]

    assert trajectory.reward == 1.0 and trajectory.finished and trajectory.error is None
    assert trajectory.policy_version == 7
    assert trajectory.actions == [c.name for calls in task.ground_truth for c in calls]
    roles = [m.role for m in trajectory.messages]
    assert roles == ["user", "assistant", "tool", "assistant"] * 2
    assert trajectory.messages[4].content == task.user_turns[1]
    assert [c.name for c in trajectory.messages[1].tool_calls] == trajectory.actions[:1]
    check_token_bookkeeping(trajectory)

    # The whole sequence is the template's rendering of the conversation, and every
    # prompt the policy saw is a prefix of it.
    env = bfcl()
    env.reset(task)
    tools = env.tools()
    rendered = render_text(
        engine.tokenizer, trajectory.messages, tools, add_generation_prompt=False
    )
    assert engine.tokenizer.decode(trajectory.token_ids) == rendered.removesuffix("\n")
    for prompt in scripted.prompts:
        assert trajectory.token_ids[: len(prompt)] == prompt
    tool_text = engine.tokenizer.decode(
        [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m == 0]
    )
    assert "Observation: " in tool_text and task.user_turns[1] in tool_text
    generated = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    assert engine.tokenizer.decode(generated).count("<|im_end|>") == len(texts)


def test_partial_credit_rewards_an_unsolved_episode_below_the_signal_threshold(
    engine: TransformersEngine, task: Task
) -> None:
    first, second = task.ground_truth
    # the first turn right, the second one's call made twice: unsolved, partly matched
    texts = [format_tool_calls(first), "Done.", format_tool_calls([*second, *second]), "Done."]
    rewards = []
    for weight in (0.0, 0.4):
        scripted = ScriptedPolicy(engine, list(texts))
        episode = run_group(scripted, bfcl, task, 1, SamplingParams(), 10, partial_credit=weight)[0]
        rewards.append(episode.reward)
    assert rewards[0] == 0.0  # BFCL's verdict: the state differs
    assert rewards[1] == pytest.approx(0.4 * (1.0 + len(second) / (2 * len(second))) / 2)
    solved_texts = [format_tool_calls(first), "Done.", format_tool_calls(second), "Done."]
    solver = ScriptedPolicy(engine, solved_texts)
    solved = run_group(solver, bfcl, task, 1, SamplingParams(), 10, partial_credit=0.4)[0]
    assert solved.reward == 1.0


def test_real_policy_group(policy: LoadedPolicy, engine: TransformersEngine, task: Task) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    trajectories = run_group(engine, bfcl, task, group_size=2, params=params, max_steps=2)
    assert len(trajectories) == 2
    assert len({t.id for t in trajectories}) == 2
    for trajectory in trajectories:
        check_token_bookkeeping(trajectory)
        assert trajectory.task_id == task.id
        assert trajectory.policy_version == engine.policy_version
        assert 0.0 <= trajectory.reward <= 1.0
        assistants = [m for m in trajectory.messages if m.role == "assistant"]
        assert 1 <= len(assistants) <= 2 and len(trajectory.entropies) == len(assistants)
        assert sum(trajectory.loss_mask) <= 10 * len(assistants)
        timings = trajectory.timings
        assert 0 < timings.generate_s <= timings.total_s and timings.environment_s > 0

    # The learner recomputes behaviour log-probs from token_ids alone: they must agree.
    trajectory = trajectories[0]
    with torch.no_grad():
        logits = policy.model(torch.tensor([trajectory.token_ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    targets = torch.tensor(trajectory.token_ids[1:]).unsqueeze(1)
    recomputed = logp.gather(1, targets).squeeze(1)
    mask = torch.tensor(trajectory.loss_mask[1:], dtype=torch.bool)
    behaviour = torch.tensor(trajectory.logprobs[1:])
    assert torch.allclose(recomputed[mask], behaviour[mask], atol=1e-3)


def test_ids_are_derived_from_the_prefix(engine: TransformersEngine, task: Task) -> None:
    scripted = ScriptedPolicy(engine, ["I cannot help.", "Still no."])
    first = run_group(scripted, bfcl, task, 1, SamplingParams(), max_steps=2, id_prefix="job-1")[0]
    assert first.finished and first.reward == 0.0 and first.actions == []
    scripted = ScriptedPolicy(engine, ["I cannot help.", "Still no."])
    again = run_group(scripted, bfcl, task, 1, SamplingParams(), max_steps=2, id_prefix="job-1")[0]
    assert again.id == first.id


# A template whose first line changes every turn: earlier text is never a prefix again.
COUNTING_TEMPLATE = (
    "<|im_start|>system\nturns={{ messages | length }}<|im_end|>\n"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_history_rewriting_template_keeps_the_seen_tokens(
    engine: TransformersEngine, task: Task
) -> None:
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = COUNTING_TEMPLATE
    texts = [format_tool_calls(task.ground_truth[0]), "Done.", "No."]
    scripted = ScriptedPolicy(engine, texts, tokenizer=tokenizer)
    trajectory = run_group(scripted, bfcl, task, 1, SamplingParams(), max_steps=3)[0]
    check_token_bookkeeping(trajectory)
    assert len(scripted.prompts) == 3
    for earlier, later in zip(scripted.prompts, scripted.prompts[1:], strict=False):
        assert later[: len(earlier)] == earlier  # what the model saw is never rewritten
    first_prompt = scripted.prompts[0]
    first_end = len(first_prompt) + len(encode_text(tokenizer, texts[0])) + 1
    tail = tokenizer.decode(scripted.prompts[1][first_end:])
    observation = trajectory.messages[2]
    assert observation.role == "tool"
    expected = f"\n<|im_start|>user\nObservation: {observation.content}<|im_end|>\n"
    assert tail == expected + "<|im_start|>assistant\n"
    assert tokenizer.decode(trajectory.token_ids).count("turns=") == 1


class BrokenStepBfcl:
    """The real BFCL environment whose ``step`` fails, as a buggy environment would."""

    def __init__(self) -> None:
        self.inner = make_environment("bfcl")
        self.name = self.inner.name
        self.closed = False

    def reset(self, task: Task) -> Any:
        return self.inner.reset(task)

    def tools(self) -> Any:
        return self.inner.tools()

    def step(self, assistant_text: str) -> Any:
        raise KeyError("state went missing")

    def execute(self, call: Any) -> Any:
        return self.inner.execute(call)

    def replay(self, ground_truth: Any) -> Any:
        return self.inner.replay(ground_truth)

    def score(self) -> float:
        return self.inner.score()

    def partial_credit(self) -> float:
        return self.inner.partial_credit()

    def close(self) -> None:
        self.closed = True


def test_environment_error_ends_the_episode_with_a_reason(
    engine: TransformersEngine, task: Task
) -> None:
    envs: list[BrokenStepBfcl] = []

    def factory() -> Any:
        envs.append(BrokenStepBfcl())
        return envs[-1]

    scripted = ScriptedPolicy(engine, ["Hello."])
    trajectory = run_group(scripted, factory, task, 1, SamplingParams(), max_steps=4)[0]
    assert trajectory.error == "environment error: KeyError: 'state went missing'"
    assert not trajectory.finished and trajectory.reward == 0.0
    assert [m.role for m in trajectory.messages] == ["user", "assistant"]
    assert envs[0].closed
