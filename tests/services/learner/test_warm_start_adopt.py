"""A learner adopts a warm start another run exported, in place of the SFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coevolve.services.learner.trainer import GrpoLearner
from coevolve.services.learner.warm_start import adopt_warm_start
from coevolve.shared.policy.weights import WeightsMismatch, weights_digest

from .conftest import PolicyFactory


def exported_warm_start(policy_factory: PolicyFactory, path: Path) -> bytes:
    """A policy whose adapter was changed and frozen as the reference, as after an SFT."""
    source = GrpoLearner(policy_factory())
    with torch.no_grad():
        for param in source.trainable:
            param.add_(0.01 * torch.randn_like(param))
    source.freeze_reference()
    blob = source.export_weights()
    path.write_bytes(blob)
    return blob


def test_an_adopted_warm_start_exports_the_same_weights(
    policy_factory: PolicyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "v1.safetensors"
    blob = exported_warm_start(policy_factory, path)
    learner = GrpoLearner(policy_factory())
    assert weights_digest(learner.export_weights()) != weights_digest(blob)

    digest = adopt_warm_start(learner, path, weights_digest(blob))

    assert digest == weights_digest(blob)
    assert weights_digest(learner.export_weights()) == digest
    assert (learner.warm_started, learner.version) == (True, 1)


def test_a_warm_start_with_another_digest_is_refused(
    policy_factory: PolicyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "v1.safetensors"
    exported_warm_start(policy_factory, path)
    learner = GrpoLearner(policy_factory())
    before = weights_digest(learner.export_weights())

    with pytest.raises(WeightsMismatch, match="not the expected"):
        adopt_warm_start(learner, path, "0" * 64)
    with pytest.raises(FileNotFoundError, match="from_policy"):
        adopt_warm_start(learner, tmp_path / "missing.safetensors")

    assert weights_digest(learner.export_weights()) == before
    assert not learner.warm_started
