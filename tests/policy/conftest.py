"""Fixtures for policy tests: the real SmolLM2-135M-Instruct, converted once and cached.

The GGUF file is converted into ``runs/test-cache`` (ignored by git; ``COEVOLVE_TEST_CACHE``
overrides it, the same directory the learner tests use); later loads take about a second.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from coevolve.shared.policy import LoadedPolicy, LoraSettings, TransformersEngine, load_policy
from coevolve.shared.policy.loading import FinetuneMode
from tests.support.cache import CACHE_DIR

PolicyFactory = Callable[..., LoadedPolicy]


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return CACHE_DIR


@pytest.fixture(scope="session")
def make_policy(cache_dir: Path) -> PolicyFactory:
    def make(finetune: FinetuneMode = "lora", lora: LoraSettings | None = None) -> LoadedPolicy:
        torch.manual_seed(0)
        return load_policy(run_dir=cache_dir, device="cpu", finetune=finetune, lora=lora)

    return make


@pytest.fixture(scope="module")
def policy(make_policy: PolicyFactory) -> LoadedPolicy:
    return make_policy()


@pytest.fixture(scope="module")
def engine(policy: LoadedPolicy) -> TransformersEngine:
    return TransformersEngine(policy)


def randomize_adapters(policy: LoadedPolicy, seed: int) -> None:
    """Give LoRA B matrices non-zero values so the adapter changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name and param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
