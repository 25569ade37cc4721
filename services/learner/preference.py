"""A learner step on preference pairs: the ``eto`` and ``coevolving_dpo`` objectives.

The step's groups (within the staleness bound, as GRPO's) become pairs
(``preference_pairs``): the expert against each failure for ``eto``, and failures ordered
by partial credit as well for ``coevolving_dpo``. Both sides are cut at ``max_tokens``.
The reference log-probs come first, without gradient, from the network GRPO's KL term uses
(``GrpoLearner.reference_model``: under LoRA the same network with the trained adapter
off, i.e. base + warm start, the policy before any preference update; under full
fine-tuning a frozen copy). Then each of ``mini_batches`` parts, ``ppo_epochs`` times, is
one AdamW update of ``dpo.dpo_loss``: a pair's two sequences run together, their common
prompt once (``SharedPrefix``) unless the pair is over the activation budget (then each
side alone, checkpointed), and its loss is backpropagated at once, normalised by the
part's pair and expert-token counts so the pairs add up to the part's mean. Under data
parallelism each rank takes a share of a part's pairs (``distributed``).

With ``preference.failure_agent`` the step then trains the failure agent
(``failure_agent.py``) the same way, on its own pairs, its weights and optimizer swapped
into the learner's; the target's pairs are the expert against both agents' failures.

Log-probs are at temperature 1 (the policy itself, whatever the rollout sampled at), and
summed over the agent's own tokens only. Without the failure agent, ``coevolving_dpo``'s
failure-vs-failure pairs go to the target: a stand-in for the paper's hard negatives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from coevolve.services.learner.distributed import GradientSum, gathered, share, world
from coevolve.services.learner.dpo import DpoStats, dpo_loss, summed_logprobs
from coevolve.services.learner.failure_agent import FailureAgent
from coevolve.services.learner.grpo import (
    SharedPrefix,
    filter_stale,
    group_version,
    shared_prompt_length,
)
from coevolve.services.learner.learner_view import LearnerView
from coevolve.services.learner.memory import (
    activation_checkpointing,
    over_budget,
    padded_tokens,
    peak_resident_gb,
    release_freed_memory,
)
from coevolve.services.learner.preference_pairs import (
    EXPERT,
    PairSide,
    PreferencePair,
    failure_agent_pairs,
    preference_pairs,
    trajectory_side,
)
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.shared.messages import RolloutGroup
from coevolve.shared.policy.logprobs import sequence_logprobs

Indexed = tuple[int, PreferencePair]


class PreferenceLearner(LearnerView, Protocol):
    """The learner as a preference step uses it: with its failure agent, when on."""

    failure_agent: FailureAgent | None


def step_pairs(
    learner: PreferenceLearner, groups: Sequence[RolloutGroup], experts: Mapping[str, PairSide]
) -> list[PreferencePair]:
    """The pairs the target trains on from ``groups``, cut at ``max_tokens``."""
    config = learner.config
    pairs = preference_pairs(
        groups,
        experts,
        config.objective,
        config.preference.failure_pairs_per_group,
        failure_agent=learner.failure_agent is not None,
    )
    return cut_pairs(pairs, config.max_tokens)


def cut_pairs(pairs: Sequence[PreferencePair], limit: int | None) -> list[PreferencePair]:
    cut = (pair.cut(limit) for pair in pairs)
    return [pair for pair in cut if pair is not None]


def pad_sides(
    sides: Sequence[tuple[list[int], list[int]]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ids, attention mask and bool loss mask of ``(token_ids, loss_mask)``s."""
    length = max(len(ids) for ids, _ in sides)
    ids = torch.full((len(sides), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sides), length), dtype=torch.long)
    mask = torch.zeros((len(sides), length), dtype=torch.bool)
    for row, (tokens, loss_mask) in enumerate(sides):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        mask[row, : len(tokens)] = torch.tensor(loss_mask, dtype=torch.bool)
    return ids.to(device), attention.to(device), mask.to(device)


def common_prompt(learner: PreferenceLearner, sides: Sequence[PairSide]) -> int:
    """The length of the prompt the sides share, to run once (0: none, or too short to
    be worth it)."""
    config = learner.config
    if not config.share_prompt:
        return 0
    length = shared_prompt_length([s.token_ids for s in sides], [s.loss_mask for s in sides])
    return length if length >= config.min_shared_prompt else 0


def pair_layout(learner: PreferenceLearner, pair: PreferencePair) -> tuple[int, bool]:
    """The length of the pair's common prompt to run once (0: none), and whether the pair
    is over the activation budget (then each side runs alone, checkpointed)."""
    sides = (pair.chosen, pair.rejected)
    prompt_length = common_prompt(learner, sides)
    held = [prompt_length, padded_tokens([len(s.token_ids) - prompt_length for s in sides])]
    if over_budget(held, learner.config.activation_tokens):
        return 0, True
    return prompt_length, False


def pair_logprobs(
    learner: PreferenceLearner,
    model: nn.Module,
    pair: PreferencePair,
    prompt_length: int,
    *,
    one_at_a_time: bool = False,
    requires_grad: bool = False,
) -> tuple[Tensor, SharedPrefix | None, int]:
    """``[2]``: the chosen and rejected sides' log-probs summed over their agent tokens,
    with the prompt run once when ``prompt_length`` > 0 (its ``backward`` is the
    caller's) or each side alone with ``one_at_a_time``; and the tokens run."""
    sides = [(s.token_ids, s.loss_mask) for s in (pair.chosen, pair.rejected)]
    device = learner.device
    if one_at_a_time:
        sums = []
        for side in sides:
            ids, attention, mask = pad_sides([side], learner.pad_id, device)
            logprobs, _ = sequence_logprobs(
                model, ids, attention, 1.0, positions=mask, with_entropy=False
            )
            sums.append(summed_logprobs(logprobs, mask))
        return torch.cat(sums), None, sum(len(ids) for ids, _ in sides)
    both = (pair.chosen, pair.rejected)
    prompt = side_prefix(learner, model, both, prompt_length, requires_grad=requires_grad)
    tokens = sum(len(s.token_ids) for s in both) - prompt_length
    return chunk_logprobs(learner, model, prompt, both, prompt_length), prompt, tokens


def side_prefix(
    learner: PreferenceLearner,
    model: nn.Module,
    sides: Sequence[PairSide],
    prompt_length: int,
    *,
    requires_grad: bool,
) -> SharedPrefix | None:
    """The sides' common first ``prompt_length`` tokens run once (None: 0 tokens)."""
    if not prompt_length:
        return None
    prompt_ids = torch.tensor(sides[0].token_ids[:prompt_length], device=learner.device)
    return SharedPrefix(model, prompt_ids, 1.0, requires_grad=requires_grad)


@torch.no_grad()
def reference_logprobs(learner: PreferenceLearner, pair: PreferencePair) -> tuple[Tensor, int]:
    """The pair's summed log-probs under the reference (no gradient), and the tokens run."""
    prompt_length, over = pair_layout(learner, pair)
    with learner.reference_model() as reference:
        logps, _, tokens = pair_logprobs(
            learner, reference, pair, prompt_length, one_at_a_time=over
        )
    return logps.detach(), tokens


def accumulate_pair(
    learner: PreferenceLearner,
    pair: PreferencePair,
    reference: Tensor,
    pair_normalizer: float,
    token_normalizer: float,
) -> tuple[DpoStats, int]:
    """Forward and backward one pair's share of the part's loss; its stats and tokens."""
    settings = learner.config.preference
    prompt_length, over = pair_layout(learner, pair)
    checkpointed = activation_checkpointing(learner.model) if over else nullcontext()
    with checkpointed:
        logps, prompt, tokens = pair_logprobs(
            learner, learner.model, pair, prompt_length, one_at_a_time=over, requires_grad=True
        )
        loss, stats = dpo_loss(
            logps[:1],
            logps[1:],
            reference[:1],
            reference[1:],
            beta=settings.beta,
            sft_coef=settings.sft_coef,
            chosen_tokens=torch.tensor([pair.chosen.agent_tokens], device=logps.device),
            expert_chosen=torch.tensor([pair.kind == "expert"], device=logps.device),
            pair_normalizer=pair_normalizer,
            token_normalizer=token_normalizer,
        )
        loss.backward()
        if prompt is not None:
            prompt.backward()
    return stats, tokens


def task_batches(pairs: Sequence[Indexed]) -> list[list[Indexed]]:
    """``pairs`` by task, in order of first appearance: a task's pairs share their prompt
    (and an eto task its expert side), which ``accumulate_task_pairs`` runs once."""
    batches: dict[str, list[Indexed]] = {}
    for indexed in pairs:
        batches.setdefault(indexed[1].task_id, []).append(indexed)
    return list(batches.values())


def distinct_sides(batch: Sequence[Indexed]) -> tuple[list[PairSide], list[tuple[int, int]]]:
    """The batch's sides, each once (an expert or a trajectory in several pairs), and per
    pair the positions of its chosen and rejected sides among them."""
    sides: list[PairSide] = []
    where: dict[tuple[str, int], int] = {}
    positions = []
    for _, pair in batch:
        indexes = []
        for side in (pair.chosen, pair.rejected):
            key = (side.source, len(side.token_ids))
            if key not in where:
                where[key] = len(sides)
                sides.append(side)
            indexes.append(where[key])
        positions.append((indexes[0], indexes[1]))
    return sides, positions


def side_chunks(
    learner: PreferenceLearner, sides: Sequence[PairSide], prompt_length: int
) -> list[list[int]] | None:
    """The sides' indexes in runs of ``micro_batch_size`` (else one by one), each run
    within the activation budget beside the prompt; None: one side alone is over it."""
    config = learner.config
    for size in dict.fromkeys((max(1, config.micro_batch_size), 1)):
        chunks = [list(range(i, min(i + size, len(sides)))) for i in range(0, len(sides), size)]
        held = (
            [prompt_length, padded_tokens([len(sides[i].token_ids) - prompt_length for i in c])]
            for c in chunks
        )
        if not any(over_budget(h, config.activation_tokens) for h in held):
            return chunks
    return None


def chunk_logprobs(
    learner: PreferenceLearner,
    model: nn.Module,
    prompt: SharedPrefix | None,
    sides: Sequence[PairSide],
    prompt_length: int,
) -> Tensor:
    """``[len(sides)]``: each side's log-probs summed over its agent tokens, after the
    common ``prompt`` (None: whole sequences)."""
    tails = [(s.token_ids[prompt_length:], s.loss_mask[prompt_length:]) for s in sides]
    ids, attention, mask = pad_sides(tails, learner.pad_id, learner.device)
    if prompt is not None:
        logprobs, _ = prompt.logprobs(ids, attention, mask, with_entropy=False)
    else:
        logprobs, _ = sequence_logprobs(
            model, ids, attention, 1.0, positions=mask, with_entropy=False
        )
    return summed_logprobs(logprobs, mask)


def sides_logprobs(
    learner: PreferenceLearner,
    model: nn.Module,
    sides: Sequence[PairSide],
    prompt_length: int,
    chunks: Sequence[Sequence[int]],
) -> Tensor:
    """``[S]`` log-probs of every side without a graph, the common prompt run once."""
    with torch.no_grad():
        prompt = side_prefix(learner, model, sides, prompt_length, requires_grad=False)
        parts = [
            chunk_logprobs(learner, model, prompt, [sides[i] for i in chunk], prompt_length)
            for chunk in chunks
        ]
    return torch.cat(parts)


def accumulate_task_pairs(
    learner: PreferenceLearner,
    batch: Sequence[Indexed],
    references: dict[int, Tensor],
    pair_normalizer: float,
    token_normalizer: float,
) -> tuple[DpoStats | None, int]:
    """Forward and backward a task's pairs together: each distinct side once, after their
    common prompt once (GRPO's ``SharedPrefix``), the reference's log-probs alike (kept in
    ``references`` by pair index for the next epochs). A group's pairs repeat its prompt,
    and ETO's its expert, so this is a fraction of the work of ``accumulate_pair`` pair
    by pair, for the same loss and gradient.

    The sides run in micro-batches within the activation budget, which DPO's coupling of
    two sides does not allow directly: a first pass without a graph gives every side's
    log-prob, hence the loss and its derivative ``w`` by each side's log-prob; the second
    pass backpropagates ``Σ w · logp`` micro-batch by micro-batch, whose gradient is the
    loss's. ``(None, 0)`` when one side alone is over the budget."""
    sides, positions = distinct_sides(batch)
    prompt_length = common_prompt(learner, sides)
    chunks = side_chunks(learner, sides, prompt_length)
    if chunks is None:
        return None, 0
    one_pass = prompt_length + sum(len(s.token_ids) - prompt_length for s in sides)
    run = 0
    chosen_at = [c for c, _ in positions]
    rejected_at = [r for _, r in positions]
    if any(index not in references for index, _ in batch):
        with learner.reference_model() as reference:
            ref_sides = sides_logprobs(learner, reference, sides, prompt_length, chunks)
        for (index, _), (c, r) in zip(batch, positions, strict=True):
            references[index] = torch.stack([ref_sides[c], ref_sides[r]])
        run += one_pass
    reference_pairs = torch.stack([references[index] for index, _ in batch])
    now = sides_logprobs(learner, learner.model, sides, prompt_length, chunks)
    leaf = now.detach().requires_grad_(True)
    settings, device = learner.config.preference, now.device
    loss, stats = dpo_loss(
        leaf[chosen_at],
        leaf[rejected_at],
        reference_pairs[:, 0],
        reference_pairs[:, 1],
        beta=settings.beta,
        sft_coef=settings.sft_coef,
        chosen_tokens=torch.tensor([p.chosen.agent_tokens for _, p in batch], device=device),
        expert_chosen=torch.tensor([p.kind == "expert" for _, p in batch], device=device),
        pair_normalizer=pair_normalizer,
        token_normalizer=token_normalizer,
    )
    (weights,) = torch.autograd.grad(loss, leaf)
    prompt = side_prefix(learner, learner.model, sides, prompt_length, requires_grad=True)
    for chunk in chunks:
        logps = chunk_logprobs(
            learner, learner.model, prompt, [sides[i] for i in chunk], prompt_length
        )
        (weights[chunk] * logps).sum().backward()
    if prompt is not None:
        prompt.backward()
    return stats, run + 2 * one_pass


def expert_tokens(pairs: Sequence[Indexed]) -> int:
    """The agent tokens of the expert chosen sides: the supervised term's normaliser."""
    return sum(pair.chosen.agent_tokens for _, pair in pairs if pair.kind == "expert")


def preference_step(
    learner: PreferenceLearner, groups: Sequence[RolloutGroup], experts: Mapping[str, PairSide]
) -> StepMetrics:
    """One step of the preference objective on ``groups`` (see the module); with the
    failure agent, one of the failure agent's too (``failure_agent_step``)."""
    started = time.perf_counter()
    config = learner.config
    agent = learner.failure_agent
    target_groups = [g for g in groups if g.agent == "target"]
    kept_target, dropped = filter_stale(target_groups, learner.version, config.max_staleness)
    staleness = [learner.version - group_version(g) for g in kept_target]
    failure_groups = [g for g in groups if g.agent == "failure"]
    kept_failure: list[RolloutGroup] = []
    if agent is not None:
        kept_failure, dropped_failure = filter_stale(
            failure_groups, agent.version, config.max_staleness
        )
        dropped += dropped_failure
    else:
        dropped += len(failure_groups)  # no failure agent here to pair them for
    kept = [*kept_target, *kept_failure]
    pairs = step_pairs(learner, kept, experts)
    stats, grad_norms, tokens = train_pairs(learner, pairs)
    updates = sum(math.isfinite(norm) for norm in grad_norms)
    if updates:
        learner.step_count += 1
        learner.version += 1
    failure = failure_agent_step(learner, agent, kept) if agent is not None else None
    # the step's groups and rewards are the target's; the failure agent's have their fields
    metrics = step_metrics(
        learner, kept_target, (dropped, staleness), pairs, stats, grad_norms, (tokens, started)
    )
    if failure is not None:
        metrics = replace(metrics, **failure)
    learner.log_metrics(metrics)
    release_freed_memory()
    return metrics


def train_pairs(
    learner: PreferenceLearner, pairs: Sequence[PreferencePair]
) -> tuple[list[DpoStats], list[float], int]:
    """``ppo_epochs`` passes over ``pairs`` in ``mini_batches`` updates of the learner's
    trainable weights: each pair's stats, each update's gradient norm, the tokens run."""
    config = learner.config
    indexed = list(enumerate(pairs))
    references: dict[int, Tensor] = {}
    stats: list[DpoStats] = []
    grad_norms: list[float] = []
    tokens = 0
    for _ in range(config.ppo_epochs):
        for part in split_pairs(indexed, config.mini_batches):
            total = GradientSum(learner.trainable)
            count, supervised = float(len(part)), float(max(expert_tokens(part), 1))
            for batch in task_batches(share(part)):
                batch_stats, run = accumulate_task_pairs(
                    learner, batch, references, count, supervised
                )
                if batch_stats is None:  # over the activation budget together: one by one
                    for index, pair in batch:
                        if index not in references:
                            references[index], ran = reference_logprobs(learner, pair)
                            run += ran
                        pair_stats, ran = accumulate_pair(
                            learner, pair, references[index], count, supervised
                        )
                        stats.append(pair_stats)
                        run += ran
                        total.collect()
                else:
                    stats.append(batch_stats)
                    total.collect()
                tokens += run
            total.finish()
            grad_norms.append(learner.apply_update())
    if world()[1] > 1:
        stats = [s for rank_stats in gathered(stats) for s in rank_stats]
        tokens = sum(gathered(tokens))
    return stats, grad_norms, tokens


def failure_agent_step(
    learner: PreferenceLearner, agent: FailureAgent, groups: Sequence[RolloutGroup]
) -> dict[str, Any]:
    """The failure agent's update on the failure pairs of ``groups`` (both agents' failures
    of each task), its weights swapped in; the ``StepMetrics`` fields that report it and
    the hard negatives: the failure agent's failures against the target's in the step."""
    limit = learner.config.preference.failure_pairs_per_group
    pairs = cut_pairs(failure_agent_pairs(groups, limit), learner.config.max_tokens)
    stats: list[DpoStats] = []
    grad_norms: list[float] = []
    if pairs:
        with agent.swapped_in(learner):
            stats, grad_norms, _ = train_pairs(learner, pairs)
    if any(math.isfinite(norm) for norm in grad_norms):
        agent.step_count += 1
        agent.version += 1
    evaluated = sum(s.pairs for s in stats)
    rewards = {
        who: [t.reward for g in groups if g.agent == who for t in g.trajectories if t.reward < 1]
        for who in ("target", "failure")
    }
    return {
        "failure_agent": True,
        "failure_agent_version": agent.version,
        "failure_agent_pairs": len(pairs),
        "failure_agent_loss": (
            sum(float(s.preference_loss) for s in stats) / evaluated if evaluated else 0.0
        ),
        "failure_agent_accuracy": (
            sum(float(s.correct) for s in stats) / evaluated if evaluated else 0.0
        ),
        "failure_agent_groups": sum(g.agent == "failure" for g in groups),
        "hard_negative_reward": _mean(rewards["failure"]),
        "target_failure_reward": _mean(rewards["target"]),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def step_metrics(
    learner: PreferenceLearner,
    kept: Sequence[RolloutGroup],
    stale: tuple[int, list[int]],
    pairs: Sequence[PreferencePair],
    stats: Sequence[DpoStats],
    grad_norms: Sequence[float],
    work: tuple[int, float],
) -> StepMetrics:
    """What the step did, in GRPO's ``StepMetrics`` (its PPO diagnostics left at 0):
    ``stale`` is the groups dropped and each kept group's staleness, ``work`` the tokens
    run and the step's start (``time.perf_counter``)."""
    dropped, staleness = stale
    tokens, started = work
    rewards = torch.tensor([r for g in kept for r in g.rewards()], dtype=torch.float32)
    duration = time.perf_counter() - started
    updates = sum(math.isfinite(norm) for norm in grad_norms)
    return StepMetrics(
        step=learner.step_count,
        version=learner.version,
        trained=updates > 0,
        groups=len(kept),
        dropped_stale=dropped,
        uniform_groups=0,
        malformed=sum(trajectory_side(t) is None for g in kept for t in g.trajectories),
        refused_truncated=0,
        updates=updates,
        reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
        reward_std=float(rewards.std(correction=0)) if len(rewards) else 0.0,
        staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        staleness_max=max(staleness, default=0),
        kl=0.0,
        clip_fraction=0.0,
        ratio_mean=0.0,
        behaviour_weight_mean=0.0,
        behaviour_weight_max=0.0,
        behaviour_capped=0.0,
        entropy=0.0,
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        tokens=tokens,
        tokens_per_s=tokens / duration if duration > 0 else 0.0,
        duration_s=duration,
        peak_rss_gb=peak_resident_gb(),
        label_s=sum(g.label_s for g in kept),
        preference=True,
        **preference_means(stats, learner.config.preference.sft_coef, pairs),
    )


def split_pairs(pairs: Sequence[Indexed], parts: int) -> list[list[Indexed]]:
    """Pairs dealt round-robin into at most ``parts`` non-empty mini-batches."""
    return [list(pairs[i::parts]) for i in range(min(parts, len(pairs)))]


def preference_means(
    stats: Sequence[DpoStats], sft_coef: float, pairs: Sequence[PreferencePair]
) -> dict[str, Any]:
    """The step's ``StepMetrics`` fields of a preference objective: means over every pair
    evaluated (each update's), the NLL per expert token."""
    evaluated = sum(s.pairs for s in stats)
    supervised = sum(s.sft_tokens for s in stats)

    def mean(name: str) -> float:
        return sum(float(getattr(s, name)) for s in stats) / evaluated if evaluated else 0.0

    preference = mean("preference_loss")
    sft = sum(s.sft_nll for s in stats) / supervised if supervised else 0.0
    sources = {side.source for p in pairs for side in (p.chosen, p.rejected)} - {EXPERT}
    return {
        "loss": preference + sft_coef * sft,
        "policy_loss": preference,
        "pairs": len(pairs),
        "failure_pairs": sum(p.kind == "failure" for p in pairs),
        "trajectories": len(sources),
        "trained_tokens": sum(p.chosen.agent_tokens + p.rejected.agent_tokens for p in pairs),
        "preference_loss": preference,
        "sft_loss": sft,
        "preference_accuracy": mean("correct"),
        "preference_margin": mean("margin"),
        "chosen_reward": mean("chosen_reward"),
        "rejected_reward": mean("rejected_reward"),
    }
