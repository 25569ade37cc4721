"""Precision: bf16 where the CPU has it, a float32 head, and behaviour log-probs that the
learner reproduces on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coevolve.shared.messages import ChatMessage
from coevolve.shared.policy import SamplingParams, TransformersEngine, load_policy
from coevolve.shared.policy.chat import render_prompt_ids
from coevolve.shared.policy.loading import PolicyLoadError, pick_dtype
from coevolve.shared.policy.logprobs import sequence_logprobs

# Per-token agreement of rollout (KV-cached, batched decoding) and learner (one full
# forward pass) log-probs on the same weights. float32 agrees to rounding. bfloat16
# transformer layers with a float32 head: any one token within 0.25 nats, 0.05 on average,
# and the mean importance ratio within 2% of 1 (measured on this machine: max 0.131).
FLOAT32_TOLERANCE = 1e-3
BF16_TOKEN_TOLERANCE = 0.25
BF16_MEAN_TOLERANCE = 0.05
BF16_RATIO_TOLERANCE = 0.02


def test_pick_dtype_follows_device_and_request(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert pick_dtype(cpu, "float32") == torch.float32
    assert pick_dtype(cpu, "bf16") == torch.bfloat16
    assert pick_dtype(torch.device("cuda"), "auto") == torch.bfloat16
    monkeypatch.setenv("COEVOLVE_DTYPE", "bfloat16")
    assert pick_dtype(cpu) == torch.bfloat16
    monkeypatch.setattr("coevolve.shared.policy.loading.cpu_supports_bf16", lambda: False)
    assert pick_dtype(cpu, "auto") == torch.float32
    monkeypatch.setattr("coevolve.shared.policy.loading.cpu_supports_bf16", lambda: True)
    assert pick_dtype(cpu, "auto") == torch.bfloat16
    with pytest.raises(PolicyLoadError, match="dtype must be"):
        pick_dtype(cpu, "float16-please")


def sampled_and_rescored(dtype: str, cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour log-probs of a sampled completion and the learner's on the same tokens."""
    policy = load_policy(run_dir=cache_dir, device="cpu", dtype=dtype)
    assert policy.extra["dtype"] == dtype
    engine = TransformersEngine(policy)
    messages = [ChatMessage(role="user", content="List the files in the current folder.")]
    prompt = render_prompt_ids(policy.tokenizer, messages, None)
    generation = engine.generate(
        [prompt] * 2, SamplingParams(max_new_tokens=24, temperature=0.8, seed=3)
    )[0]
    ids = torch.tensor([prompt + generation.completion_ids])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt) :] = True
    with torch.no_grad():
        learner, _ = sequence_logprobs(policy.model, ids, torch.ones_like(ids), 0.8, positions=mask)
    return torch.tensor(generation.logprobs), learner[mask]


def test_float32_behaviour_and_learner_logprobs_agree(cache_dir: Path) -> None:
    behaviour, learner = sampled_and_rescored("float32", cache_dir)
    assert torch.allclose(behaviour, learner, atol=FLOAT32_TOLERANCE)


def test_bf16_keeps_a_float32_head_and_logprobs_within_tolerance(cache_dir: Path) -> None:
    policy = load_policy(run_dir=cache_dir, device="cpu", dtype="bfloat16")
    base = policy.model.get_base_model()
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    assert base.get_output_embeddings().weight.dtype == torch.float32
    logits = policy.model(input_ids=torch.tensor([[1, 2, 3]]), logits_to_keep=1).logits
    assert logits.dtype == torch.float32

    behaviour, learner = sampled_and_rescored("bfloat16", cache_dir)
    difference = (behaviour - learner).abs()
    ratio_mean = float(torch.exp(learner - behaviour).mean())
    assert float(difference.max()) < BF16_TOKEN_TOLERANCE, f"max |diff| {difference.max():.4f}"
    assert float(difference.mean()) < BF16_MEAN_TOLERANCE, f"mean |diff| {difference.mean():.4f}"
    assert abs(ratio_mean - 1.0) < BF16_RATIO_TOLERANCE, f"mean ratio {ratio_mean:.4f}"
