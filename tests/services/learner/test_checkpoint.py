"""Checkpoints: a restored learner continues exactly where the saved one was."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from coevolve.services.learner import checkpoint
from coevolve.services.learner.checkpoint import load_checkpoint, save_checkpoint
from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.trainer import GrpoLearner

from .conftest import GroupFactory, PolicyFactory


def small_model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model[0].requires_grad_(False)  # like a frozen base under LoRA
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_restored_learner_has_same_counters_optimizer_and_next_loss(
    policy_factory: PolicyFactory, make_group: GroupFactory, tmp_path: Path
) -> None:
    settings = LearnerConfig(micro_batch_size=8, lr=1e-3)
    first = make_group([1.0, 0.0, 1.0, 0.0])
    second = make_group([0.0, 1.0, 0.0, 1.0], version=1, offset=4)

    original = GrpoLearner(policy_factory(), settings)
    original.step([first])
    path = tmp_path / "learner.pt"
    original.save_checkpoint(path)
    saved_optimizer = copy.deepcopy(original.optimizer.state_dict())
    saved_weights = [p.detach().clone() for p in original.trainable]
    expected = original.step([second])  # what the original does next

    restored = GrpoLearner(policy_factory(), settings)
    fresh = zip(restored.trainable, saved_weights, strict=True)
    assert not all(torch.equal(a, b) for a, b in fresh)
    restored.restore_checkpoint(path)

    assert (restored.step_count, restored.version) == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(restored.trainable, saved_weights, strict=True))
    state = restored.optimizer.state_dict()["state"]
    assert set(state) == set(saved_optimizer["state"]) and state
    for index, saved in saved_optimizer["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key], saved[key])

    actual = restored.step([second])
    assert actual.loss == expected.loss
    assert actual.kl == expected.kl
    assert (actual.step, actual.version) == (expected.step, expected.version) == (2, 2)
    after = zip(restored.trainable, original.trainable, strict=True)
    assert all(torch.equal(a, b) for a, b in after)


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    model, optimizer = small_model_and_optimizer(seed=1)
    path = tmp_path / "ckpt.pt"
    random.seed(7)
    save_checkpoint(path, model, optimizer, step=3, version=5, extra={"note": "x"})
    expected_draws = (torch.rand(3), random.random())

    other, other_optimizer = small_model_and_optimizer(seed=2)
    state = load_checkpoint(path, other, other_optimizer)
    assert (state.step, state.version, state.extra) == (3, 5, {"note": "x"})
    assert torch.equal(other[2].weight, model[2].weight)
    assert not torch.equal(other[0].weight, model[0].weight)  # frozen: not in the checkpoint
    assert torch.equal(
        other_optimizer.state_dict()["state"][0]["exp_avg"],
        optimizer.state_dict()["state"][0]["exp_avg"],
    )
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert random.random() == expected_draws[1]


def test_a_crash_while_saving_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = small_model_and_optimizer(seed=1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, optimizer, step=1, version=1)
    before = path.read_bytes()

    def dies_half_way(payload: Any, handle: Any) -> None:
        handle.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint.torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model, optimizer, step=2, version=2)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left
    assert load_checkpoint(path, model, optimizer).step == 1


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    model, optimizer = small_model_and_optimizer(seed=1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, optimizer, step=1, version=1)
    other = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    other_optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="trainable parameters differ"):
        load_checkpoint(path, other, other_optimizer)


def test_a_restored_learner_trains_with_its_configured_optimizer_settings(
    policy_factory: PolicyFactory, make_group: GroupFactory, tmp_path: Path
) -> None:
    saved_with = LearnerConfig(micro_batch_size=8, lr=3e-4, weight_decay=0.0)
    original = GrpoLearner(policy_factory(), saved_with)
    original.step([make_group([1.0, 0.0, 1.0, 0.0])])
    path = tmp_path / "learner.pt"
    original.save_checkpoint(path)

    configured = LearnerConfig(micro_batch_size=8, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1)
    restored = GrpoLearner(policy_factory(), configured)
    restored.restore_checkpoint(path)

    for group in restored.optimizer.param_groups:
        assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (
            1e-3,
            (0.8, 0.99),
            0.1,
        )
    assert restored.optimizer.state  # the moments are the checkpoint's
