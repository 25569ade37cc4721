"""Log-probs of given tokens under the policy, at a temperature, from logits kept only
where they are needed: the learner's ratios and the held-out eval's likelihood of the
ground truth both read them."""

from __future__ import annotations

from typing import Any

import torch
import transformers.modeling_utils
from torch import Tensor, nn

Temperature = float | Tensor
"""One temperature, or one per sequence (a ``[B]`` tensor)."""

# transformers releases without this helper read a 2-D ``logits_to_keep`` as positions and
# fail on a mask (seen with 5.17 on a GPU host); there every logit is computed, then picked
MASKED_LOGITS_TO_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")


def masked_logits(model: nn.Module, keep: Tensor, **inputs: Any) -> Tensor:
    """``model``'s logits at the True positions of the bool ``[B, T]`` mask ``keep``, as
    ``[N, V]`` rows in row-major order; the vocabulary projection runs only there where
    transformers supports it."""
    if MASKED_LOGITS_TO_KEEP:
        logits: Tensor = model(**inputs, logits_to_keep=keep).logits
        return logits
    return model(**inputs).logits[keep]


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: Temperature, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``targets`` under ``logits / temperature`` (rows), and the entropy.

    ``temperature`` is a number or one value per row of ``logits``.
    """
    if isinstance(temperature, Tensor):
        temperature = temperature.to(logits.device, torch.float32)[:, None]
    scaled = logits.float() / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    chosen = scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(scaled, dim=-1)
            entropy = log_norm - (probs * scaled).sum(dim=-1)
    return chosen, entropy


def entry_temperatures(temperature: Temperature, wanted: Tensor) -> Temperature:
    """The temperature of each True entry of ``wanted`` ([B, T], row-major order)."""
    if not isinstance(temperature, Tensor):
        return temperature
    return temperature.to(wanted.device)[:, None].expand(wanted.shape)[wanted]


def check_temperature(temperature: Temperature) -> None:
    if bool(torch.as_tensor(temperature).le(0).any()):
        raise ValueError("temperature must be > 0 to score sampled tokens")


def sequence_logprobs(
    model: nn.Module,
    token_ids: Tensor,
    attention_mask: Tensor,
    temperature: Temperature = 1.0,
    *,
    positions: Tensor | None = None,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each token under ``model`` at ``temperature``, and the entropy there.

    Token t is scored with the logits at position t-1 (so entry 0 is always 0). The
    temperature must be the one the rollout sampled with (per sequence, a ``[B]`` tensor,
    when they differ), or the ratio against the behaviour log-probs is biased.
    ``positions`` (bool ``[B, T]``, e.g. the loss mask) restricts the
    vocabulary projection to the tokens that are needed; other entries are returned as 0.
    Entropy is computed without gradient (it is a diagnostic).
    Returns ``[B, T]`` tensors.
    """
    check_temperature(temperature)
    wanted = torch.ones_like(token_ids, dtype=torch.bool) if positions is None else positions.bool()
    wanted = wanted.clone()
    wanted[:, 0] = False
    # logits at t-1 predict token t
    predictors = torch.zeros_like(wanted)
    predictors[:, :-1] = wanted[:, 1:]

    logits = masked_logits(
        model, predictors, input_ids=token_ids, attention_mask=attention_mask, use_cache=False
    )
    # logits: [N, V], the rows of `predictors` in order, i.e. the tokens of `wanted`
    chosen, entropy = token_logprobs(
        logits, token_ids[wanted], entry_temperatures(temperature, wanted), with_entropy
    )
    logprobs = torch.zeros(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    logprobs = logprobs.masked_scatter(wanted, chosen)
    entropies = None
    if entropy is not None:
        entropies = torch.zeros_like(logprobs).masked_scatter(wanted, entropy)
    return logprobs, entropies
