"""GRPO, written out: group-relative advantages, the clipped surrogate, KL, staleness.

The objective is the paper's (``seeds/000``):

    J(θ) = 1/Σ_k|τ_k| · Σ_k Σ_t min(r_kt·A_k, clip(r_kt, 1-ε_low, 1+ε_high)·A_k) - β·KL(π_θ‖π_ref)

with ``r_kt = π_θ(a_t|s_t) / π_behaviour(a_t|s_t)``. We minimise ``-J``.

Choices worth knowing:

* **Token-level mean over the whole batch** (DAPO-style; also what the paper's
  ``1/Σ|τ_k|`` normaliser says): every generated token weighs the same, so long
  trajectories are not down-weighted as they are under a per-sequence mean. Under gradient
  accumulation the caller passes the batch's total token count as ``token_normalizer`` so
  the micro-batches add up to exactly that mean.
* **The ratio is taken against the behaviour log-probs** recorded by the rollout engine, so
  an asynchronous learner corrects for the (bounded) lag between the weights that sampled a
  trajectory and the weights being trained.
* **KL uses the k3 estimator** ``exp(q - p) - (q - p) - 1`` with ``p`` the policy and ``q``
  the reference log-prob of the sampled token: unbiased for KL(π_θ‖π_ref), always >= 0.
* **Asymmetric clipping** (``clip_eps_high`` >= ``clip_eps_low``, DAPO's "clip-higher") is
  allowed; equal values give the classic PPO clip.
* **Advantages use the population std** of the group (so K=1 is defined) and are exactly 0
  when all rewards are equal: such a group carries no policy-gradient signal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from coevolve.shared.messages import RolloutGroup


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """``(r - mean) / (std + eps)`` along the last dimension (one group per row).

    A group whose rewards are all equal gets exactly zero advantage, not rounding noise.
    """
    rewards = rewards.to(torch.float32)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, correction=0)
    advantages = (rewards - mean) / (std + eps)
    uniform = rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(advantages), advantages)


@dataclass(frozen=True)
class GrpoStats:
    """Diagnostics of one loss evaluation, as means over the masked (generated) tokens."""

    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    entropy: float | None
    tokens: int


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π‖π_ref) from sampled-token log-probs (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_beta: float = 0.0,
    *,
    entropies: Tensor | None = None,
    token_normalizer: float | None = None,
) -> tuple[Tensor, GrpoStats]:
    """The GRPO loss (``-J``) for a batch of sequences.

    ``logprobs``, ``behaviour_logprobs``, ``ref_logprobs``, ``loss_mask`` and ``entropies``
    are ``[B, T]`` and aligned (entry t is about token t); ``advantages`` is ``[B]`` (one
    per trajectory) or ``[B, T]``. Only tokens with ``loss_mask == 1`` contribute, and they
    are averaged over ``token_normalizer`` (default: their count in this batch).
    ``ref_logprobs`` may be None only when ``kl_beta == 0``.
    """
    if ref_logprobs is None and kl_beta != 0.0:
        raise ValueError("kl_beta > 0 needs reference log-probs")
    mask = loss_mask.to(logprobs.dtype)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    # Masked positions are zeroed before exp() so padding can never produce inf * 0 = nan.
    log_ratio = torch.where(mask > 0, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    policy_per_token = -torch.minimum(unclipped, clipped)

    if ref_logprobs is not None:
        safe_ref = torch.where(mask > 0, ref_logprobs, logprobs.detach())
        kl_per_token = k3_kl(logprobs, safe_ref)
    else:
        kl_per_token = torch.zeros_like(logprobs)
    loss_per_token = policy_per_token + kl_beta * kl_per_token

    tokens = int(mask.sum().item())
    normalizer = float(token_normalizer) if token_normalizer is not None else max(tokens, 1)
    loss = (loss_per_token * mask).sum() / normalizer

    with torch.no_grad():
        count = max(tokens, 1)
        was_clipped = ((ratio < 1.0 - clip_eps_low) & (advantages < 0)) | (
            (ratio > 1.0 + clip_eps_high) & (advantages > 0)
        )
        stats = GrpoStats(
            loss=float((loss_per_token * mask).sum() / count),
            policy_loss=float((policy_per_token * mask).sum() / count),
            kl=float((kl_per_token * mask).sum() / count),
            clip_fraction=float((was_clipped.to(mask.dtype) * mask).sum() / count),
            ratio_mean=float((ratio * mask).sum() / count),
            entropy=None if entropies is None else float((entropies * mask).sum() / count),
            tokens=tokens,
        )
    return loss, stats


def group_version(group: RolloutGroup) -> int:
    """The oldest policy version that contributed to a group."""
    versions = [t.policy_version for t in group.trajectories]
    return min([group.policy_version, *versions])


def filter_stale(
    groups: Sequence[RolloutGroup], current_version: int, max_staleness: int
) -> tuple[list[RolloutGroup], int]:
    """Keep groups at most ``max_staleness`` versions behind ``current_version``.

    Returns the kept groups (in order) and how many were dropped.
    """
    kept = [g for g in groups if current_version - group_version(g) <= max_staleness]
    return kept, len(groups) - len(kept)


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``targets`` under ``logits / temperature`` (rows), and the entropy."""
    scaled = logits.float() / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    chosen = scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(scaled, dim=-1)
            entropy = log_norm - (probs * scaled).sum(dim=-1)
    return chosen, entropy


def sequence_logprobs(
    model: nn.Module,
    token_ids: Tensor,
    attention_mask: Tensor,
    temperature: float = 1.0,
    *,
    positions: Tensor | None = None,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each token under ``model`` at ``temperature``, and the entropy there.

    Token t is scored with the logits at position t-1 (so entry 0 is always 0). The
    temperature must be the one the rollout sampled with, or the ratio against the behaviour
    log-probs is biased. ``positions`` (bool ``[B, T]``, e.g. the loss mask) restricts the
    vocabulary projection to the tokens that are needed; other entries are returned as 0.
    Entropy is computed without gradient (it is a diagnostic).
    Returns ``[B, T]`` tensors.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 to score sampled tokens")
    wanted = torch.ones_like(token_ids, dtype=torch.bool) if positions is None else positions.bool()
    wanted = wanted.clone()
    wanted[:, 0] = False
    # logits at t-1 predict token t
    predictors = torch.zeros_like(wanted)
    predictors[:, :-1] = wanted[:, 1:]

    output = model(
        input_ids=token_ids,
        attention_mask=attention_mask,
        logits_to_keep=predictors,
        use_cache=False,
    )
    # output.logits: [N, V], the rows of `predictors` in order, i.e. the tokens of `wanted`
    chosen, entropy = token_logprobs(output.logits, token_ids[wanted], temperature, with_entropy)
    logprobs = torch.zeros(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    logprobs = logprobs.masked_scatter(wanted, chosen)
    entropies = None
    if entropy is not None:
        entropies = torch.zeros_like(logprobs).masked_scatter(wanted, entropy)
    return logprobs, entropies


def shared_prompt_length(
    token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]]
) -> int:
    """Length of the prompt all sequences share, up to (not including) any trained token."""
    limit = min(min(len(ids) for ids in token_ids), *(list(m).index(1) for m in loss_masks))
    first = token_ids[0]
    length = 0
    while length < limit and all(ids[length] == first[length] for ids in token_ids):
        length += 1
    return length


class SharedPrefix:
    """A prompt shared by several sequences, run through the model once.

    Every sequence of a GRPO group starts with the same prompt (for BFCL, the tools prompt
    is most of the tokens), so scoring the K continuations against one cached copy of the
    prompt instead of K full sequences cuts the work several-fold. The gradient stays
    exact: the prompt's keys/values enter each continuation's forward pass as leaf tensors
    that collect their gradients over all micro-batches, and ``backward()`` then sends the
    sum through the prompt's own graph once.

    With ``requires_grad=False`` (the reference policy, or evaluation) no graph is kept.
    """

    def __init__(
        self, model: nn.Module, prompt_ids: Tensor, temperature: float, *, requires_grad: bool
    ) -> None:
        if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
            raise ValueError("the shared prompt must be a non-empty 1-D tensor of token ids")
        self.model = model
        self.temperature = temperature
        self.requires_grad = requires_grad
        self.length = int(prompt_ids.numel())
        with torch.set_grad_enabled(requires_grad):
            output = model(input_ids=prompt_ids[None], use_cache=True, logits_to_keep=1)
        self.graph_outputs: list[Tensor] = []
        self.leaves: list[Tensor] = []
        cache = output.past_key_values
        self.layers: list[tuple[Tensor, Tensor]] = []
        for layer in cache.layers:
            keys, values = self.attach(layer.keys), self.attach(layer.values)
            self.layers.append((keys, values))
        self.last_logits = self.attach(output.logits[0, -1])

    def attach(self, tensor: Tensor) -> Tensor:
        if not self.requires_grad:
            return tensor.detach()
        leaf = tensor.detach().requires_grad_(True)
        self.graph_outputs.append(tensor)
        self.leaves.append(leaf)
        return leaf

    def logprobs(
        self,
        continuation_ids: Tensor,
        attention_mask: Tensor,
        positions: Tensor,
        *,
        with_entropy: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Like ``sequence_logprobs`` for ``prompt + continuation`` rows, continuation part.

        ``continuation_ids``/``attention_mask``/``positions`` are ``[B, S]`` (right-padded);
        entry j of the result is the log-prob of continuation token j (token 0 is scored
        by the prompt's last logits).
        """
        batch, length = continuation_ids.shape
        wanted = positions.bool()
        predictors = torch.zeros_like(wanted)
        predictors[:, :-1] = wanted[:, 1:]
        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.layers):
            cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), index)
        prompt_mask = torch.ones(batch, self.length, dtype=attention_mask.dtype)
        position_ids = torch.arange(self.length, self.length + length).expand(batch, length)
        output = self.model(
            input_ids=continuation_ids,
            attention_mask=torch.cat([prompt_mask.to(attention_mask.device), attention_mask], 1),
            position_ids=position_ids.to(continuation_ids.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=predictors,
        )
        later, later_entropy = token_logprobs(
            output.logits, continuation_ids[:, 1:][wanted[:, 1:]], self.temperature, with_entropy
        )
        first, first_entropy = token_logprobs(
            self.last_logits.expand(batch, -1),
            continuation_ids[:, 0],
            self.temperature,
            with_entropy,
        )
        logprobs = join_first(wanted, first, later)
        entropies = None
        if first_entropy is not None and later_entropy is not None:
            entropies = join_first(wanted, first_entropy, later_entropy)
        return logprobs, entropies

    def backward(self) -> None:
        """Send the gradients the continuations left on the prompt through its graph."""
        pairs = [
            (out, leaf.grad) for out, leaf in zip(self.graph_outputs, self.leaves, strict=True)
        ]
        pairs = [(out, grad) for out, grad in pairs if grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        self.graph_outputs, self.leaves, self.layers = [], [], []


def join_first(wanted: Tensor, first: Tensor, later: Tensor) -> Tensor:
    """``[B, S]`` values: column 0 from ``first`` ([B]), the wanted rest from ``later``."""
    head = torch.where(wanted[:, 0], first, torch.zeros_like(first))[:, None]
    tail = torch.zeros(wanted[:, 1:].shape, dtype=later.dtype, device=later.device)
    return torch.cat([head, tail.masked_scatter(wanted[:, 1:], later)], dim=1)
