"""The engine's KV cache: written in place, equal to recomputing every step from scratch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from coevolve.shared.messages import ChatMessage
from coevolve.shared.policy import (
    FINISH_STOP,
    Generation,
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    render_prompt_ids,
)
from coevolve.shared.policy import engine as engine_module
from coevolve.shared.policy.logprobs import sequence_logprobs
from tests.policy.conftest import PolicyFactory, randomize_adapters
from tests.policy.test_engine import TOOLS

QUESTIONS = ["Hi!", "Name three colours of the rainbow, then stop.", "What is 2+2?"]


def chat_prompts(
    policy: LoadedPolicy, tools: list[dict[str, Any]] | None = None
) -> list[list[int]]:
    return [
        render_prompt_ids(policy.tokenizer, [ChatMessage(role="user", content=q)], tools)
        for q in QUESTIONS
    ]


def recomputed_greedy(policy: LoadedPolicy, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with no cache: the whole sequence through the model at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = policy.model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def teacher_forced(policy: LoadedPolicy, generation: Generation) -> tuple[torch.Tensor, ...]:
    """The learner's log-probs and entropies of the completion, from one forward pass."""
    ids = torch.tensor([generation.prompt_ids + generation.completion_ids])
    wanted = torch.zeros_like(ids, dtype=torch.bool)
    wanted[0, len(generation.prompt_ids) :] = True
    with torch.no_grad():
        logprobs, entropies = sequence_logprobs(
            policy.model, ids, torch.ones_like(ids), generation.temperature, positions=wanted
        )
    assert entropies is not None
    return logprobs[wanted], entropies[wanted]


def assert_matches_learner(policy: LoadedPolicy, generations: list[Generation]) -> None:
    for generation in generations:
        logprobs, entropies = teacher_forced(policy, generation)
        assert torch.allclose(torch.tensor(generation.logprobs), logprobs, atol=2e-4)
        assert torch.allclose(torch.tensor(generation.entropies), entropies, atol=1e-3)


@contextmanager
def forward_log(policy: LoadedPolicy) -> Iterator[list[dict[str, Any]]]:
    """Per forward pass of the policy: the input shape, the cache and its key storage."""
    calls: list[dict[str, Any]] = []

    def after(_module: Any, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:  # made by the model
            cache = output.past_key_values
        keys = cache.layers[0].keys
        calls.append(
            {
                "shape": tuple(kwargs["input_ids"].shape),
                "cache": cache,
                "storage": keys.untyped_storage().data_ptr(),
            }
        )

    handle = policy.model.register_forward_hook(after, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def test_greedy_equals_full_recompute_for_rows_of_different_lengths(
    policy: LoadedPolicy,
) -> None:
    engine = TransformersEngine(policy, min_shared_prefix=1)
    prompts = chat_prompts(policy)
    assert len({len(p) for p in prompts}) == 3
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0))
    assert engine.stats.prefix_prefilled_tokens > 0  # rows start from the copied prefix
    lengths = [len(g.completion_ids) for g in ours]
    # a row that ends early leaves the batch while the others go on
    assert ours[0].finish_reason == FINISH_STOP and lengths[0] < max(lengths)
    for prompt, generation in zip(prompts, ours, strict=True):
        expected = recomputed_greedy(policy, prompt, len(generation.completion_ids))
        assert generation.completion_ids == expected


def test_sampled_logprobs_match_a_teacher_forced_pass_across_turns(
    make_policy: PolicyFactory,
) -> None:
    policy = make_policy()
    randomize_adapters(policy, seed=4)
    engine = TransformersEngine(policy)
    prompts = chat_prompts(policy, TOOLS)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=5)
    first = engine.generate(prompts, params)
    assert_matches_learner(policy, first)

    # the next turn extends the kept prefix in a new cache; the rows then start from it
    reply = chat_prompts(policy)[0][-6:]
    second = engine.generate([g.prompt_ids + g.completion_ids + reply for g in first], params)
    assert engine.stats.prefix_reused_tokens > 0
    assert_matches_learner(policy, second)


def test_each_token_is_fed_once_into_one_cache_written_in_place(policy: LoadedPolicy) -> None:
    engine = TransformersEngine(policy, stop_tokens={-1}, min_shared_prefix=1)
    prompts = chat_prompts(policy)
    with forward_log(policy) as calls:
        engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=0))
    shared = engine.stats.prefix_prefilled_tokens
    prefix, rows = calls[0], calls[1:]
    assert prefix["shape"] == (1, shared)
    suffix = max(len(p) for p in prompts) - shared
    # the prompts' own tokens once, then one token a row a step: no history is recomputed
    assert [c["shape"] for c in rows] == [(3, suffix)] + [(3, 1)] * 5
    # every step writes into the storage allocated for the call: no copy of the cache
    assert all(c["cache"] is rows[0]["cache"] for c in rows)
    assert {c["storage"] for c in rows} == {rows[0]["storage"]}

    # a call that reuses the whole kept prefix copies it into its rows, not recomputing it
    kept = engine._prefix
    assert kept is not None
    with forward_log(policy) as again:
        engine.generate(prompts, SamplingParams(max_new_tokens=2, seed=0))
    assert engine._prefix is kept
    assert [c["shape"] for c in again] == [(3, suffix), (3, 1)]


def test_slot_layer_keeps_rows_in_place() -> None:
    layer = engine_module._SlotLayer(capacity=5)
    keys, values = torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8)
    layer.update(keys, values)
    step_keys, step_values = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)
    seen_keys, _ = layer.update(step_keys, step_values)
    assert torch.equal(seen_keys, torch.cat([keys, step_keys], dim=2))
    storage = seen_keys.untyped_storage().data_ptr()

    layer.batch_select_indices(torch.tensor([1, 3]))
    assert layer.get_seq_length() == 4
    assert torch.equal(layer.keys, torch.cat([keys, step_keys], dim=2)[[1, 3]])
    assert torch.equal(layer.values, torch.cat([values, step_values], dim=2)[[1, 3]])
    assert layer.keys is not None and layer.keys.untyped_storage().data_ptr() == storage
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    with pytest.raises(RuntimeError, match="cannot take"):
        layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))


def test_models_without_plain_attention_keep_the_dynamic_cache(
    policy: LoadedPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = chat_prompts(policy)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    expected = TransformersEngine(policy).generate(prompts, greedy)
    monkeypatch.setattr(engine_module, "plain_attention_layers", lambda _model: 0)
    dynamic = TransformersEngine(policy)
    got = dynamic.generate(prompts, greedy)
    assert dynamic.stats.prefix_prefilled_tokens == 0
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.completion_ids == theirs.completion_ids
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=2e-4)
