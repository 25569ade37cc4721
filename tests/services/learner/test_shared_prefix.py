"""SharedPrefix run again in chunks in backward: the gradient of the prompt kept whole."""

from __future__ import annotations

import torch

from coevolve.services.learner.grpo import SharedPrefix
from coevolve.services.learner.memory import saved_for_backward
from coevolve.shared.policy import LoadedPolicy


def prompt_gradient(
    policy: LoadedPolicy, recompute_chunk: int | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The flat LoRA gradient of two continuations' summed log-probs after a 37-token
    prompt, their log-probs and the bytes autograd saved while the prompt was set up."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 5000, (37,), generator=generator)
    continuations = torch.randint(0, 5000, (2, 9), generator=generator)
    attention = torch.ones_like(continuations)
    positions = torch.ones_like(continuations, dtype=torch.bool)
    with saved_for_backward() as saved:
        shared = SharedPrefix(
            policy.model, prompt, 0.8, requires_grad=True, recompute_chunk=recompute_chunk
        )
    logprobs, _ = shared.logprobs(continuations, attention, positions, with_entropy=False)
    logprobs.sum().backward()
    shared.backward()
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    flat = torch.cat([p.grad.flatten() for p in trainable if p.grad is not None])
    policy.model.zero_grad(set_to_none=True)
    return flat, logprobs.detach(), saved[0]


def test_a_prompt_run_again_in_chunks_gives_the_kept_prompts_gradient(
    policy: LoadedPolicy,
) -> None:
    with torch.no_grad():  # LoRA's B starts at 0; give the adapter a gradient path
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    kept, kept_logprobs, kept_bytes = prompt_gradient(policy, None)
    chunked, chunked_logprobs, chunked_bytes = prompt_gradient(policy, 10)  # 4 chunks

    assert kept.abs().sum() > 0
    assert torch.allclose(chunked_logprobs, kept_logprobs, atol=1e-4)
    assert float((kept - chunked).norm() / kept.norm()) < 1e-4
    assert kept_bytes > 0 and chunked_bytes == 0  # no graph held for the prompt


def test_a_chunk_as_long_as_the_prompt_keeps_the_graph(policy: LoadedPolicy) -> None:
    prompt = torch.arange(1, 8)
    shared = SharedPrefix(policy.model, prompt, 1.0, requires_grad=True, recompute_chunk=7)
    assert shared.chunks == [] and shared.graph_outputs
