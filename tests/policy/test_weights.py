"""Weight transfer: exported from one policy, imported into a fresh one, identical logits."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors

from coevolve.shared.policy import (
    LoadedPolicy,
    LoraSettings,
    SamplingParams,
    TransformersEngine,
    WeightsMismatch,
    export_weights,
    import_weights,
    weights_digest,
    weights_kind,
)
from tests.policy.conftest import PolicyFactory, randomize_adapters

PROBE = torch.tensor([[1, 504, 3458, 314, 260, 3575, 30, 2], [1, 9690, 198, 2683, 416, 946, 30, 2]])


def logits_of(policy: LoadedPolicy) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = policy.model(PROBE).logits
    return out


def test_lora_weights_round_trip_to_identical_logits(make_policy: PolicyFactory) -> None:
    source = make_policy()
    randomize_adapters(source, seed=11)
    torch.manual_seed(123)  # the fresh policy draws different LoRA A matrices
    target = make_policy()
    torch.manual_seed(123)
    assert not torch.equal(logits_of(source), logits_of(target))

    blob = export_weights(source)
    tensors = load_safetensors(blob)
    assert weights_kind(source.model) == "lora"
    assert set(tensors) == {n for n, p in source.model.named_parameters() if p.requires_grad}
    assert len(blob) < 20_000_000  # the adapter, not the 135M base weights
    import_weights(target.model, blob, expected_sha256=weights_digest(blob))
    assert torch.equal(logits_of(source), logits_of(target))


def test_engine_hot_swap_loads_the_new_version(make_policy: PolicyFactory) -> None:
    source = make_policy()
    randomize_adapters(source, seed=5)
    engine = TransformersEngine(make_policy())
    before = engine.generate([[1, 9690, 198]], SamplingParams(max_new_tokens=6, temperature=0.0))
    engine.load_weights(export_weights(source), version=4)
    assert engine.policy_version == 4
    assert torch.equal(logits_of(engine.policy), logits_of(source))
    after = engine.generate([[1, 9690, 198]], SamplingParams(max_new_tokens=6, temperature=0.0))
    source_engine = TransformersEngine(source)
    expected = source_engine.generate(
        [[1, 9690, 198]], SamplingParams(max_new_tokens=6, temperature=0.0)
    )
    assert after[0].completion_ids == expected[0].completion_ids
    assert after[0].logprobs == expected[0].logprobs
    assert before[0].logprobs != after[0].logprobs


def test_full_weights_round_trip(make_policy: PolicyFactory) -> None:
    source = make_policy(finetune="full")
    with torch.no_grad():
        for param in source.model.parameters():
            param.mul_(1.01)
    target = make_policy(finetune="full")
    blob = export_weights(source)
    assert weights_kind(source.model) == "full"
    import_weights(target.model, blob)
    assert torch.equal(logits_of(source), logits_of(target))


def test_mismatched_or_corrupted_blobs_are_refused(make_policy: PolicyFactory) -> None:
    source = make_policy()
    other = make_policy(lora=LoraSettings(rank=4))
    blob = export_weights(source)
    with pytest.raises(WeightsMismatch, match="shape"):
        import_weights(other.model, blob)
    narrow = make_policy(lora=LoraSettings(target_modules=("q_proj",)))
    with pytest.raises(WeightsMismatch, match="unknown"):
        import_weights(narrow.model, blob)
    with pytest.raises(WeightsMismatch, match="sha256"):
        import_weights(source.model, blob, expected_sha256="0" * 64)
    frozen = make_policy(finetune="none")
    with pytest.raises(WeightsMismatch, match="no trainable"):
        export_weights(frozen.model)


def test_the_same_weights_export_to_the_same_bytes(make_policy: PolicyFactory) -> None:
    policy = make_policy()
    digests = {weights_digest(export_weights(policy)) for _ in range(8)}
    assert len(digests) == 1  # a version's digest names its weights, nothing else
