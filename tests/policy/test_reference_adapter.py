"""The warm-started policy as a frozen reference adapter under a fresh trained adapter."""

from __future__ import annotations

import torch

from coevolve.shared.policy import export_weights, import_weights
from coevolve.shared.policy.adapters import freeze_trained_as_reference, has_reference_adapter
from tests.policy.conftest import PolicyFactory, randomize_adapters
from tests.policy.test_weights import logits_of


def test_freezing_keeps_the_policy_and_makes_it_the_reference(make_policy: PolicyFactory) -> None:
    policy = make_policy()
    randomize_adapters(policy, seed=7)  # stands for the warm start's adapter
    warm = logits_of(policy)
    with policy.reference():
        base = logits_of(policy)
    assert not torch.equal(warm, base)  # before freezing, the reference is the base model

    freeze_trained_as_reference(policy.model)
    assert has_reference_adapter(policy.model)
    assert torch.allclose(logits_of(policy), warm, atol=1e-5)  # fresh adapter adds nothing
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all(".default." in n for n in trainable)

    randomize_adapters(policy, seed=8)  # GRPO moves the fresh adapter
    with torch.no_grad(), policy.reference():
        reference = logits_of(policy)
    assert torch.allclose(reference, warm, atol=1e-5)
    assert not torch.allclose(logits_of(policy), warm, atol=1e-3)
    after = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert after == trainable  # the reference pass left the trained set as it was


def test_exported_stack_rebuilds_in_a_fresh_policy(make_policy: PolicyFactory) -> None:
    source = make_policy()
    randomize_adapters(source, seed=3)
    freeze_trained_as_reference(source.model)
    randomize_adapters(source, seed=4)
    target = make_policy()
    assert not has_reference_adapter(target.model)
    import_weights(target, export_weights(source))
    assert has_reference_adapter(target.model)
    assert torch.equal(logits_of(target), logits_of(source))
    with torch.no_grad(), source.reference(), target.reference():
        assert torch.equal(logits_of(target), logits_of(source))
