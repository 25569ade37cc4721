"""DPO with a supervised term on the expert, the preference objectives' loss.

For pairs ``i`` with log-probs summed over the agent's own tokens (``π`` the policy,
``ref`` the reference: the policy before preference training, see ``preference``):

    L = 1/P · Σ_i -log σ(β·[(π(c_i) - ref(c_i)) - (π(r_i) - ref(r_i))])
        + sft_coef · 1/N · Σ_{i expert} -π(c_i)

with ``N`` the agent tokens of the expert chosen sides. It is TRL's DPO loss
(``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1, sft_coef]``), except that the
supervised term counts only pairs whose chosen side is the expert (a failure chosen over a
worse failure is not imitated); on expert pairs alone the two agree
(tests/services/learner/test_dpo.py). The project's function rather than TRL's
``DPOTrainer``: that trainer owns the training loop and masks whole completions, while
this learner trains LoRA in its own asynchronous loop on sequences whose tool results and
user turns sit between the agent's messages and must carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class DpoStats:
    """Sums over the pairs of one loss evaluation (divide by ``pairs`` for means);
    ``reward`` is DPO's implicit reward ``β·(π - ref)``."""

    pairs: int
    preference_loss: float  # Σ -log σ(margin)
    sft_nll: float  # Σ -π(c) over the expert chosen sides
    sft_tokens: int
    correct: int  # pairs whose margin is > 0
    margin: float  # Σ β·[(π(c) - ref(c)) - (π(r) - ref(r))]
    chosen_reward: float
    rejected_reward: float


def summed_logprobs(token_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """``[B]``: each row's log-probs summed over its agent tokens (``loss_mask`` 1)."""
    mask = loss_mask.to(torch.bool)
    return torch.where(mask, token_logprobs, torch.zeros_like(token_logprobs)).sum(dim=-1)


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    sft_coef: float = 0.0,
    chosen_tokens: Tensor | None = None,
    expert_chosen: Tensor | None = None,
    pair_normalizer: float | None = None,
    token_normalizer: float | None = None,
) -> tuple[Tensor, DpoStats]:
    """The loss above for ``[P]`` summed log-probs (``summed_logprobs``).

    ``chosen_tokens`` (``[P]``) counts each chosen side's agent tokens and
    ``expert_chosen`` (bool ``[P]``, default all True) says which chosen sides are the
    expert's; both are needed only when ``sft_coef > 0``. Under gradient accumulation the
    caller passes the whole batch's pair count and expert-token count as
    ``pair_normalizer`` and ``token_normalizer`` so the parts add up to the batch's loss.
    """
    if beta <= 0:
        raise ValueError("beta must be > 0")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    margin = beta * (chosen_ratio - rejected_ratio)
    per_pair = -F.logsigmoid(margin)
    pairs = float(pair_normalizer) if pair_normalizer is not None else max(len(margin), 1)
    loss = per_pair.sum() / pairs
    nll = torch.zeros((), dtype=chosen_logps.dtype, device=chosen_logps.device)
    sft_tokens = 0
    if sft_coef > 0:
        if chosen_tokens is None:
            raise ValueError("sft_coef > 0 needs chosen_tokens")
        expert = (
            torch.ones_like(chosen_logps, dtype=torch.bool)
            if expert_chosen is None
            else expert_chosen.to(torch.bool)
        )
        nll = -torch.where(expert, chosen_logps, torch.zeros_like(chosen_logps)).sum()
        sft_tokens = int(chosen_tokens[expert].sum())
        tokens = float(token_normalizer) if token_normalizer is not None else max(sft_tokens, 1)
        loss = loss + sft_coef * nll / tokens
    with torch.no_grad():
        stats = DpoStats(
            pairs=len(margin),
            preference_loss=float(per_pair.sum()),
            sft_nll=float(nll),
            sft_tokens=sft_tokens,
            correct=int((margin > 0).sum()),
            margin=float(margin.sum()),
            chosen_reward=float(beta * chosen_ratio.sum()),
            rejected_reward=float(beta * rejected_ratio.sum()),
        )
    return loss, stats
