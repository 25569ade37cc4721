"""Log-probs are the same whether transformers projects only the kept positions or
(releases that read a 2-D ``logits_to_keep`` as positions) every position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coevolve.services.learner.grpo import SharedPrefix
from coevolve.shared.policy import load_policy
from coevolve.shared.policy import logprobs as module
from coevolve.shared.policy.logprobs import sequence_logprobs

CACHE_DIR = Path(__file__).resolve().parents[2] / "runs/test-cache"


def test_the_full_projection_fallback_gives_the_same_logprobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = load_policy(run_dir=CACHE_DIR, device="cpu", dtype="float32")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5000, (2, 24), generator=generator)
    attention = torch.ones_like(ids)
    positions = torch.rand(2, 24, generator=generator) > 0.4
    prompt = torch.randint(0, 5000, (20,), generator=generator)

    def scores() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            whole, _ = sequence_logprobs(policy.model, ids, attention, 0.8, positions=positions)
            shared = SharedPrefix(policy.model, prompt, 0.8, requires_grad=False)
            continued, _ = shared.logprobs(ids, attention, positions, with_entropy=False)
        return whole, continued

    assert module.MASKED_LOGITS_TO_KEEP  # this environment's transformers projects a mask
    kept = scores()
    monkeypatch.setattr(module, "MASKED_LOGITS_TO_KEEP", False)
    projected_everywhere = scores()
    for a, b in zip(kept, projected_everywhere, strict=True):
        assert torch.count_nonzero(a) > 0
        assert torch.allclose(a, b, atol=1e-5)
