"""The adapter stack written as one peft adapter (what the vLLM engine hands vLLM) gives a
fresh base model the policy's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from coevolve.shared.policy.adapters import freeze_trained_as_reference
from coevolve.shared.policy.merged_adapter import CONFIG_FILE, write_merged_adapter
from tests.policy.conftest import PolicyFactory, randomize_adapters


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_warm_start_and_grpo_adapters_as_one_give_the_same_logits(
    make_policy: PolicyFactory, tmp_path: Path
) -> None:
    policy = make_policy()
    randomize_adapters(policy, seed=1)  # the warm start's adapter
    freeze_trained_as_reference(policy.model)
    randomize_adapters(policy, seed=2)  # GRPO's
    expected = logits(policy.model)

    directory = write_merged_adapter(policy.model, tmp_path / "v3")
    config = json.loads((directory / CONFIG_FILE).read_text())
    assert config["r"] == 2 * policy.lora.rank == config["lora_alpha"]  # type: ignore[union-attr]
    assert set(config["target_modules"]) == set(policy.lora.target_modules)  # type: ignore[union-attr]

    base = AutoModelForCausalLM.from_pretrained(policy.cache_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(directory)).eval()
    # one rank-32 product instead of two rank-16 ones: float32 rounding through the layers
    gap = float((logits(merged) - expected).abs().max())
    with merged.disable_adapter():  # the adapters' own effect, for scale
        effect = float((logits(merged) - expected).abs().max())
    assert gap < 1e-3 < 0.1 < effect


def test_a_model_without_adapters_is_refused(make_policy: PolicyFactory, tmp_path: Path) -> None:
    policy = make_policy(finetune="full")
    with pytest.raises(ValueError, match="no LoRA adapter"):
        write_merged_adapter(policy.model, tmp_path / "none")
