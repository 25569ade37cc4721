"""The in-process engine: batched left-padded sampling with behaviour log-probs."""

from __future__ import annotations

import pytest
import torch

from coevolve.shared.messages import ChatMessage
from coevolve.shared.policy import (
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    Generation,
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    render_prompt_ids,
)
from tests.policy.conftest import PolicyFactory, randomize_adapters


def prompts_for(policy: LoadedPolicy) -> list[list[int]]:
    questions = ["Hi!", "Name three colours of the rainbow, then stop.", "What is 2+2?"]
    return [
        render_prompt_ids(policy.tokenizer, [ChatMessage(role="user", content=q)], None)
        for q in questions
    ]


def recompute(policy: LoadedPolicy, generation: Generation) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the completion from one unpadded forward pass."""
    ids = torch.tensor([generation.prompt_ids + generation.completion_ids])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(generation.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / generation.temperature, dim=-1)
    chosen = logp.gather(1, torch.tensor(generation.completion_ids).unsqueeze(1)).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


def test_engine_satisfies_the_protocol(engine: TransformersEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.max_context == 8192
    assert engine.policy_version == 0


def test_batched_logprobs_match_the_learners_recomputation(
    policy: LoadedPolicy, engine: TransformersEngine
) -> None:
    prompts = prompts_for(policy)
    assert len({len(p) for p in prompts}) == 3  # rows really are padded differently
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=1)
    generations = engine.generate(prompts, params)
    assert len(generations) == 3
    for prompt, generation in zip(prompts, generations, strict=True):
        assert generation.prompt_ids == prompt
        assert generation.temperature == 0.7
        n = len(generation.completion_ids)
        assert 1 <= n <= 12 and len(generation.logprobs) == n == len(generation.entropies)
        chosen, entropy = recompute(policy, generation)
        assert torch.allclose(torch.tensor(generation.logprobs), chosen, atol=2e-4)
        assert torch.allclose(torch.tensor(generation.entropies), entropy, atol=2e-4)
        assert all(lp <= 0.0 for lp in generation.logprobs)


def test_finish_reasons_and_text(policy: LoadedPolicy, engine: TransformersEngine) -> None:
    prompts = prompts_for(policy)
    short = engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=2))
    assert all(g.finish_reason == FINISH_LENGTH and len(g.completion_ids) == 3 for g in short)
    long = engine.generate(prompts[:1], SamplingParams(max_new_tokens=48, temperature=0.0))[0]
    assert long.finish_reason == FINISH_STOP
    assert long.completion_ids[-1] in engine.stop_ids
    assert not any(t in engine.stop_ids for t in long.completion_ids[:-1])
    assert long.text == policy.tokenizer.decode(long.completion_ids[:-1])
    assert long.text and "<|im_end|>" not in long.text


def test_greedy_matches_transformers_generate(
    policy: LoadedPolicy, engine: TransformersEngine
) -> None:
    prompt = prompts_for(policy)[1]
    ours = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    with torch.no_grad():
        theirs = policy.model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=10,
        )[0, len(prompt) :].tolist()
    assert ours.completion_ids == theirs[: len(ours.completion_ids)]


def test_same_seed_same_sample(policy: LoadedPolicy, engine: TransformersEngine) -> None:
    prompts = prompts_for(policy)[:2]
    params = SamplingParams(max_new_tokens=8, seed=7)
    first, second = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [g.completion_ids for g in first] == [g.completion_ids for g in second]


def test_prompt_longer_than_the_context_is_refused(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError, match="context"):
        engine.generate([[1] * engine.max_context], SamplingParams(max_new_tokens=4))
    assert engine.generate([], SamplingParams()) == []


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i} of the test.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    for i in range(4)
]


def tool_prompts(policy: LoadedPolicy, questions: list[str]) -> list[list[int]]:
    return [
        render_prompt_ids(policy.tokenizer, [ChatMessage(role="user", content=q)], TOOLS)
        for q in questions
    ]


def test_shared_prefix_is_prefilled_once_and_reused_next_turn(make_policy: PolicyFactory) -> None:
    policy = make_policy()
    randomize_adapters(policy, seed=2)
    engine = TransformersEngine(policy)
    prompts = tool_prompts(policy, ["Call tool 1.", "Use tool_2 with x=3 please."])
    params = SamplingParams(max_new_tokens=6, temperature=0.9, seed=3)
    first = engine.generate(prompts, params)
    shared = engine.stats.prefix_prefilled_tokens
    assert shared > 150  # the system prompt with the tools, once, not once per row
    assert engine.stats.suffix_prefilled_tokens == sum(len(p) for p in prompts) - 2 * shared
    for generation in first:
        chosen, _ = recompute(policy, generation)
        assert torch.allclose(torch.tensor(generation.logprobs), chosen, atol=2e-4)

    # the next turn extends each conversation: the kept prefix is reused, not recomputed
    observation = tool_prompts(policy, ["ok"])[0][-8:]
    second_prompts = [g.prompt_ids + g.completion_ids + observation for g in first]
    second = engine.generate(second_prompts, params)
    assert engine.stats.prefix_reused_tokens == shared
    for generation in second:
        chosen, _ = recompute(policy, generation)
        assert torch.allclose(torch.tensor(generation.logprobs), chosen, atol=2e-4)

    unshared = TransformersEngine(policy, share_prefix=False).generate(second_prompts, params)
    assert unshared[0].completion_ids[0] == second[0].completion_ids[0]
    assert unshared[0].logprobs[0] == pytest.approx(second[0].logprobs[0], abs=2e-4)


def test_prefix_cache_is_dropped_when_weights_change(make_policy: PolicyFactory) -> None:
    policy = make_policy()
    engine = TransformersEngine(policy)
    prompts = tool_prompts(policy, ["Call tool 1.", "Call tool 3."])
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    engine.generate(prompts, params)
    randomize_adapters(policy, seed=9)  # in-place training step, as a learner would do
    after = engine.generate(prompts, params)
    assert engine.stats.prefix_reused_tokens == 0
    for generation in after:
        chosen, _ = recompute(policy, generation)
        assert torch.allclose(torch.tensor(generation.logprobs), chosen, atol=2e-4)


def test_a_stop_string_ends_its_row_only_and_stays_in_the_text(
    policy: LoadedPolicy, engine: TransformersEngine
) -> None:
    prompts = prompts_for(policy)[1:]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    free = engine.generate(prompts, greedy)
    words = free[0].text.split()
    stop = next(w for w in words[2:] if w not in free[1].text)  # in row 0's text only
    stopped = engine.generate(prompts, SamplingParams(**{**greedy.__dict__, "stop": (stop,)}))
    first = stopped[0]
    assert first.finish_reason == FINISH_STOP and stop in first.text
    assert first.completion_ids == free[0].completion_ids[: len(first.completion_ids)]
    assert len(first.completion_ids) < len(free[0].completion_ids)
    # the string ended the row as soon as it was complete
    assert stop not in policy.tokenizer.decode(first.completion_ids[:-1])
    assert stopped[1].completion_ids == free[1].completion_ids
