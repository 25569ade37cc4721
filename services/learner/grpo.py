"""GRPO, written out: group-relative advantages, the decoupled clipped surrogate, KL, staleness.

The objective is the paper's (``seeds/000``) with AReaL's decoupled PPO correction for
off-policy data:

    J(θ) = 1/Σ_k|τ_k| · Σ_k Σ_t w_kt · min(r_kt·A_k, clip(r_kt, 1-ε_low, 1+ε_high)·A_k)
           - β·KL(π_θ‖π_ref)

    r_kt = π_θ(a_t|s_t) / π_prox(a_t|s_t)          (the trust region)
    w_kt = min(π_prox(a_t|s_t) / π_behav(a_t|s_t), w_max)   (off-policy correction, no gradient)

``π_behav`` is the policy that sampled the trajectory (its log-probs come with it),
``π_prox`` the learner's weights at the start of the step (recomputed without gradient).
We minimise ``-J``.

Choices worth knowing:

* **Decoupled clip** (AReaL). Clipping against the behaviour policy, as plain PPO does,
  zeroes the gradient of every token on which a stale policy and the current one disagree
  by more than ε; clipping against the proximal policy keeps stale data useful, and the
  behaviour-to-proximal weight corrects for where it was sampled. With one update per
  step ``π_prox = π_θ``, so ``r = 1`` and the loss is the importance-weighted policy
  gradient. Without ``proximal_logprobs`` ``grpo_loss`` falls back to plain PPO
  (``π_prox = π_behav``, ``w = 1``).
* **The weight is truncated at the cap, not masked**: a token whose ``π_prox/π_behav``
  exceeds ``w_max`` is trained with weight ``w_max`` (as V-trace truncates its importance
  weights), so no token weighs more than ``w_max`` (at the first update, where ``r = 1``,
  no token's term exceeds ``w_max·|A|``) and none is silently dropped. The share of capped
  tokens is reported.
* **Token-level mean over the whole batch** (DAPO-style; also what the paper's
  ``1/Σ|τ_k|`` normaliser says): every generated token weighs the same, so long
  trajectories are not down-weighted as they are under a per-sequence mean. Under gradient
  accumulation the caller passes the batch's total token count as ``token_normalizer`` so
  the micro-batches add up to exactly that mean.
* **Log-probs are taken at each trajectory's sampling temperature** (``Trajectory.
  temperature``), so policy, proximal, behaviour and reference log-probs all describe the
  distribution that was sampled from. ``temperature`` may be a per-sequence tensor.
* **KL uses the k3 estimator** ``exp(q - p) - (q - p) - 1`` with ``p`` the policy and ``q``
  the reference log-prob of the sampled token: unbiased for KL(π_θ‖π_ref), always >= 0.
* **Asymmetric clipping** (``clip_eps_high`` >= ``clip_eps_low``, DAPO's "clip-higher") is
  allowed; equal values give the classic PPO clip.
* **Advantages use the population std** of the group (so K=1 is defined) and are exactly 0
  when all rewards are equal: such a group carries no policy-gradient signal.
* **Step credit** (AgentEvolver's self-attributing; only when trajectories carry
  ``step_labels``, see ``rollout.step_credit``). A trajectory's labels count only when
  there is one per step, i.e. per run of 1s in its ``loss_mask`` (the i-th run holds the
  tokens of the i-th assistant message it generated: ``shared/attribution/steps.py``);
  others count as unlabelled. The labels (+1 GOOD, -1 BAD) of every labelled step of the
  group are pooled, neutral (0) ones left out, and standardised:
  ``s = scale·(l - mean) / (std + eps)``, population std over the pool, ``scale`` =
  ``step_credit_scale`` (0.2), ``eps`` = ``advantage_eps``; a pool whose labels are all
  equal (or empty) gives every step ``s = 0``, and so does a neutral label. The advantage
  of token t of a trajectory is then ``A_k + s_ki`` when t lies in step i, and ``A_k``
  elsewhere (outside steps the mask is 0 anyway): the outcome advantage stays on every
  token, the step's joins it on that step's tokens only (no suffix sums, no per-trajectory
  weighting, unlike AgentEvolver's ADCA-GRPO). The origin factor
  (``origin_advantage_scale``) multiplies both. Without labels nothing changes: the
  advantages stay ``[B]``, bit for bit as before.
* **Navigated trajectories** (AgentEvolver's self-navigating; ``rollout.navigation``)
  were sampled with advice in the prompt, ``π_behav(a_t | s_t, e)``, and are trained
  without it: their tokens, ``token_ids`` and ``π_prox(a_t | s_t)`` hold no advice
  (``shared/episodes.py`` swaps the prompt back). The change of prompt is one more way the
  sampling policy differs from the proximal one, so it goes through the same weight,
  ``w_kt = min(π_prox(a_t|s_t) / π_behav(a_t|s_t, e), w_nav)``, with its own cap ``w_nav``
  = ``navigated_weight_cap`` (1.0). Why this and why 1: the ratio is the exact importance
  weight for having sampled from the advised distribution, so nothing else corrects for
  it; where the advice made a token likelier than the plain policy would, the weight is
  below 1 and the token counts in proportion; where the plain policy already prefers it,
  the cap keeps an advised token from weighing more than an on-policy one (an advised
  success must not dominate the group's gradient through a large ratio). AgentEvolver
  instead clips navigated tokens with their own clip range and no weight; here the clip
  stays the decoupled one against ``π_prox``, which already ignores where they were
  sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from coevolve.shared.messages import RolloutGroup
from coevolve.shared.policy.logprobs import (
    Temperature,
    check_temperature,
    entry_temperatures,
    masked_logits,
    token_logprobs,
)


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


def step_advantages(
    labels: Sequence[Sequence[int]], scale: float, eps: float = 1e-6
) -> list[list[float]]:
    """One advantage per step of each trajectory of a group, from its step labels (see the
    module's "Step credit"): the group's nonzero labels standardised together, times
    ``scale``; 0 for a neutral label and for every step when those labels all agree."""
    pooled = torch.tensor([v for row in labels for v in row if v], dtype=torch.float32)
    if pooled.numel() == 0 or bool(pooled.amax() == pooled.amin()):
        return [[0.0] * len(row) for row in labels]
    mean = pooled.mean()
    std = pooled.std(correction=0)
    return [[float(scale * (v - mean) / (std + eps)) if v else 0.0 for v in row] for row in labels]


def step_token_advantages(
    spans: Sequence[tuple[int, int]], values: Sequence[float], length: int
) -> list[float]:
    """Per token of a sequence of ``length``: ``values[i]`` on the tokens of ``spans[i]``
    (cut at ``length``), 0 elsewhere; spans without a value get 0."""
    out = [0.0] * length
    for (start, end), value in zip(spans, values, strict=False):
        for position in range(start, min(end, length)):
            out[position] = value
    return out


@dataclass(frozen=True)
class GrpoStats:
    """Diagnostics of one loss evaluation, as means over the masked (generated) tokens.

    ``ratio_mean`` and ``clip_fraction`` are about ``π_θ/π_prox``; ``behaviour_weight_mean``
    is the mean applied (capped) ``π_prox/π_behav``, ``behaviour_weight_max`` its largest
    value before the cap, ``behaviour_capped`` the share of tokens the cap truncated.
    """

    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    entropy: float | None
    tokens: int
    behaviour_weight_mean: float = 1.0
    behaviour_weight_max: float = 1.0
    behaviour_capped: float = 0.0


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
    proximal_logprobs: Tensor | None = None,
    behaviour_weight_cap: float | Tensor | None = None,
    entropies: Tensor | None = None,
    token_normalizer: float | None = None,
) -> tuple[Tensor, GrpoStats]:
    """The GRPO loss (``-J``) for a batch of sequences.

    ``logprobs``, ``behaviour_logprobs``, ``proximal_logprobs``, ``ref_logprobs``,
    ``loss_mask`` and ``entropies`` are ``[B, T]`` and aligned (entry t is about token t);
    ``advantages`` is ``[B]`` (one per trajectory) or ``[B, T]``. Only tokens with
    ``loss_mask == 1`` contribute, and they are averaged over ``token_normalizer``
    (default: their count in this batch).

    With ``proximal_logprobs`` the objective is the decoupled one: clip against them and
    weight each token by ``min(π_prox/π_behav, behaviour_weight_cap)`` (None: no cap; a
    ``[B]`` tensor: one cap per sequence, as navigated trajectories have their own).
    Without, it is plain PPO against the behaviour log-probs. ``ref_logprobs`` may be
    None only when ``kl_beta == 0``.
    """
    if ref_logprobs is None and kl_beta != 0.0:
        raise ValueError("kl_beta > 0 needs reference log-probs")
    caps_given = behaviour_weight_cap is not None
    if caps_given and bool((torch.as_tensor(behaviour_weight_cap) <= 0).any()):
        raise ValueError("behaviour_weight_cap must be > 0")
    mask = loss_mask.to(logprobs.dtype)
    on = mask > 0
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    zeros = torch.zeros_like(logprobs)
    anchor = behaviour_logprobs if proximal_logprobs is None else proximal_logprobs.detach()
    # Masked positions are zeroed before exp() so padding can never produce inf * 0 = nan.
    log_ratio = torch.where(on, logprobs - anchor, zeros)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    log_weight = torch.where(on, anchor.detach() - behaviour_logprobs, zeros).detach()
    raw_weight = torch.exp(log_weight)
    cap: float | Tensor = math.inf if behaviour_weight_cap is None else behaviour_weight_cap
    if isinstance(cap, Tensor):
        cap = cap.to(raw_weight)[:, None].expand_as(raw_weight)
    weight = torch.minimum(raw_weight, torch.as_tensor(cap, dtype=raw_weight.dtype))
    capped = raw_weight > cap
    policy_per_token = -weight * torch.minimum(unclipped, clipped)

    if ref_logprobs is not None:
        safe_ref = torch.where(on, ref_logprobs, logprobs.detach())
        kl_per_token = k3_kl(logprobs, safe_ref)
    else:
        kl_per_token = torch.zeros_like(logprobs)
    loss_per_token = policy_per_token + kl_beta * kl_per_token

    tokens = int(mask.sum().item())
    normalizer = float(token_normalizer) if token_normalizer is not None else max(tokens, 1)
    loss = (loss_per_token * mask).sum() / normalizer

    with torch.no_grad():
        count = max(tokens, 1)

        def mean(values: Tensor) -> float:
            return float((values.to(mask.dtype) * mask).sum() / count)

        was_clipped = ((ratio < 1.0 - clip_eps_low) & (advantages < 0)) | (
            (ratio > 1.0 + clip_eps_high) & (advantages > 0)
        )
        largest_log_weight = float(log_weight[on].max()) if tokens else 0.0
        stats = GrpoStats(
            loss=mean(loss_per_token),
            policy_loss=mean(policy_per_token),
            kl=mean(kl_per_token),
            clip_fraction=mean(was_clipped),
            ratio_mean=mean(ratio),
            entropy=None if entropies is None else mean(entropies),
            tokens=tokens,
            behaviour_weight_mean=mean(weight),
            # in float64 and bounded, so a wildly stale token still reports a finite number
            behaviour_weight_max=math.exp(min(largest_log_weight, 700.0)),
            behaviour_capped=mean(capped),
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

    With ``requires_grad=False`` (the reference or proximal policy, evaluation) no graph
    is kept. ``temperature`` is the default for ``logprobs``, which may be given others.

    With ``recompute_chunk`` (a prompt whose activations would not fit the learner's
    budget) the prompt first runs without a graph, in chunks of at most that many tokens,
    keeping only its keys/values; ``backward()`` then runs each chunk again with its graph,
    last chunk first, and sends its gradients on before the next: the same gradient, with
    one chunk's activations held at a time, for one more forward pass over the prompt.
    """

    def __init__(
        self,
        model: nn.Module,
        prompt_ids: Tensor,
        temperature: float,
        *,
        requires_grad: bool,
        recompute_chunk: int | None = None,
    ) -> None:
        if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
            raise ValueError("the shared prompt must be a non-empty 1-D tensor of token ids")
        if recompute_chunk is not None and recompute_chunk < 1:
            raise ValueError(f"recompute_chunk must be at least 1, got {recompute_chunk}")
        self.model = model
        self.temperature = temperature
        self.requires_grad = requires_grad
        self.prompt_ids = prompt_ids
        self.length = int(prompt_ids.numel())
        self.graph_outputs: list[Tensor] = []
        self.leaves: list[Tensor] = []
        self.layers: list[tuple[Tensor, Tensor]] = []
        self.chunks: list[tuple[int, int]] = []
        if requires_grad and recompute_chunk is not None and recompute_chunk < self.length:
            self.chunks = [
                (start, min(start + recompute_chunk, self.length))
                for start in range(0, self.length, recompute_chunk)
            ]
            with torch.no_grad():
                layers, last_logits = self.run_chunks(self.chunks, [])
            for keys, values in layers:
                self.layers.append((self.leaf(keys), self.leaf(values)))
            self.last_logits = self.leaf(last_logits)
            return
        with torch.set_grad_enabled(requires_grad):
            output = model(input_ids=prompt_ids[None], use_cache=True, logits_to_keep=1)
        for layer in output.past_key_values.layers:
            keys, values = self.attach(layer.keys), self.attach(layer.values)
            self.layers.append((keys, values))
        self.last_logits = self.attach(output.logits[0, -1])

    def leaf(self, tensor: Tensor) -> Tensor:
        leaf = tensor.detach().requires_grad_(True)
        self.leaves.append(leaf)
        return leaf

    def run_chunks(
        self, chunks: Sequence[tuple[int, int]], past: Sequence[tuple[Tensor, Tensor]]
    ) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
        """Run the prompt's ``chunks`` in order after ``past`` (the keys/values of the
        tokens before the first); returns every layer's keys/values up to the last chunk's
        end and that chunk's last logits."""
        layers = list(past)
        logits = torch.empty(0)
        for start, end in chunks:
            cache = DynamicCache()
            for index, (keys, values) in enumerate(layers):
                cache.update(keys, values, index)
            output = self.model(
                input_ids=self.prompt_ids[None, start:end],
                position_ids=torch.arange(start, end, device=self.prompt_ids.device)[None],
                past_key_values=cache if layers else None,
                use_cache=True,
                logits_to_keep=1,
            )
            layers = [(layer.keys, layer.values) for layer in output.past_key_values.layers]
            logits = output.logits[0, -1]
        return layers, logits

    def attach(self, tensor: Tensor) -> Tensor:
        if not self.requires_grad:
            return tensor.detach()
        self.graph_outputs.append(tensor)
        return self.leaf(tensor)

    def logprobs(
        self,
        continuation_ids: Tensor,
        attention_mask: Tensor,
        positions: Tensor,
        *,
        with_entropy: bool = True,
        temperature: Temperature | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Like ``sequence_logprobs`` for ``prompt + continuation`` rows, continuation part.

        ``continuation_ids``/``attention_mask``/``positions`` are ``[B, S]`` (right-padded);
        entry j of the result is the log-prob of continuation token j (token 0 is scored
        by the prompt's last logits). ``temperature`` (one, or ``[B]``) defaults to the
        prefix's own.
        """
        if temperature is None:
            temperature = self.temperature
        check_temperature(temperature)
        batch, length = continuation_ids.shape
        wanted = positions.bool()
        predictors = torch.zeros_like(wanted)
        predictors[:, :-1] = wanted[:, 1:]
        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.layers):
            cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), index)
        prompt_mask = torch.ones(batch, self.length, dtype=attention_mask.dtype)
        position_ids = torch.arange(self.length, self.length + length).expand(batch, length)
        logits = masked_logits(
            self.model,
            predictors,
            input_ids=continuation_ids,
            attention_mask=torch.cat([prompt_mask.to(attention_mask.device), attention_mask], 1),
            position_ids=position_ids.to(continuation_ids.device),
            past_key_values=cache,
            use_cache=True,
        )
        later, later_entropy = token_logprobs(
            logits,
            continuation_ids[:, 1:][wanted[:, 1:]],
            entry_temperatures(temperature, wanted[:, 1:]),
            with_entropy,
        )
        first, first_entropy = token_logprobs(
            self.last_logits.expand(batch, -1), continuation_ids[:, 0], temperature, with_entropy
        )
        logprobs = join_first(wanted, first, later)
        entropies = None
        if first_entropy is not None and later_entropy is not None:
            entropies = join_first(wanted, first_entropy, later_entropy)
        return logprobs, entropies

    def backward(self) -> None:
        """Send the gradients the continuations left on the prompt through its graph."""
        if self.chunks:
            self.backward_by_chunks()
        else:
            pairs = [
                (out, leaf.grad) for out, leaf in zip(self.graph_outputs, self.leaves, strict=True)
            ]
            pairs = [(out, grad) for out, grad in pairs if grad is not None]
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        self.graph_outputs, self.leaves, self.layers = [], [], []

    def backward_by_chunks(self) -> None:
        """Each chunk run again with its graph, last first: its keys/values (and the last
        chunk's logits) take the gradients left on them, and what flows back to the earlier
        tokens' keys/values is added to theirs before their chunk runs."""
        grads = [
            torch.zeros_like(leaf) if leaf.grad is None else leaf.grad.clone()
            for leaf in self.leaves
        ]
        logits_grad = grads.pop()  # the last leaf is the prompt's last logits
        full = [(keys.detach(), values.detach()) for keys, values in self.layers]
        for start, end in reversed(self.chunks):
            past = [
                (
                    keys[:, :, :start].clone().requires_grad_(True),
                    values[:, :, :start].clone().requires_grad_(True),
                )
                for keys, values in (full if start else [])
            ]
            with torch.enable_grad():
                layers, logits = self.run_chunks([(start, end)], past)
            outputs: list[Tensor] = []
            upstream: list[Tensor] = []
            for index, (keys, values) in enumerate(layers):
                outputs += [keys[:, :, start:end], values[:, :, start:end]]
                upstream += [
                    grads[2 * index][:, :, start:end],
                    grads[2 * index + 1][:, :, start:end],
                ]
            if end == self.length:
                outputs.append(logits)
                upstream.append(logits_grad)
            torch.autograd.backward(outputs, upstream)
            for index, (keys, values) in enumerate(past):
                for offset, tensor in ((0, keys), (1, values)):
                    if tensor.grad is not None:
                        grads[2 * index + offset][:, :, :start] += tensor.grad


def join_first(wanted: Tensor, first: Tensor, later: Tensor) -> Tensor:
    """``[B, S]`` values: column 0 from ``first`` ([B]), the wanted rest from ``later``."""
    head = torch.where(wanted[:, 0], first, torch.zeros_like(first))[:, None]
    tail = torch.zeros(wanted[:, 1:].shape, dtype=later.dtype, device=later.device)
    return torch.cat([head, tail.masked_scatter(wanted[:, 1:], later)], dim=1)
