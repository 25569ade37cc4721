"""The GRPO learner: turns batches of rollout groups into optimizer steps.

One ``step`` takes the groups gathered since the last one, drops those older than the
staleness bound, refuses trajectories it cannot score exactly (malformed ones, and those
sampled from a truncated distribution: ``top_p < 1``, ``top_k`` or greedy, counted apart),
and computes group-relative advantages. Every trajectory is scored at the temperature it
was sampled at. The loss is the decoupled PPO objective of ``grpo``: clipped against the
proximal policy (the weights at the start of the step), weighted by the capped
proximal-to-behaviour ratio, so data sampled by older weights still carries gradient.

By default a step is one AdamW update over the whole batch; the proximal log-probs are
then the detached values of the same forward pass (no extra compute). With ``ppo_epochs``
or ``mini_batches`` above 1 the proximal log-probs are computed first in a no-grad pass,
then the batch is split into ``mini_batches`` parts (whole groups) and each part gets its
own update, ``ppo_epochs`` times over. Each part runs the policy (and the reference, for
the KL term) in micro-batches with gradient accumulation and clips the gradient norm.
Each step makes one new policy version, however many updates it made.

The reference policy is the base model: with LoRA (the default) it is the same network
with its adapters switched off, so it costs no memory; under full fine-tuning a frozen copy
of the starting weights is kept (only when the KL term or a preference objective is on).

``LearnerConfig.objective`` chooses what a step optimises: GRPO (the default, above) or a
preference objective on pairs built from the step's groups (``eto``, ``coevolving_dpo``;
``preference.py``), against the same reference. A checkpoint records its objective, and
resuming it under another is refused.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from coevolve.services.learner.checkpoint import load_checkpoint, save_checkpoint
from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.distributed import GradientSum, gathered, share, world
from coevolve.services.learner.failure_agent import FailureAgent
from coevolve.services.learner.grpo import (
    GrpoStats,
    SharedPrefix,
    filter_stale,
    group_advantages,
    group_version,
    grpo_loss,
    shared_prompt_length,
    step_advantages,
    step_token_advantages,
)
from coevolve.services.learner.memory import (
    activation_checkpointing,
    over_budget,
    padded_tokens,
    peak_resident_gb,
    release_freed_memory,
)
from coevolve.services.learner.preference import preference_step
from coevolve.services.learner.preference_pairs import PairSide
from coevolve.services.learner.sft import accumulate_sft_gradients, prompt_key
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.shared.attribution.steps import labels_fit, step_spans
from coevolve.shared.demonstrations import SftExample
from coevolve.shared.messages import RolloutGroup, Trajectory
from coevolve.shared.policy import LoadedPolicy, export_weights
from coevolve.shared.policy.adapters import freeze_trained_as_reference
from coevolve.shared.policy.logprobs import sequence_logprobs

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One trajectory as trained: ``proximal_logprobs`` are filled in by the no-grad pass
    before several updates (None: the detached log-probs of the update's own pass).
    ``step_advantages`` (per token, 0 outside steps) are added to the outcome ``advantage``
    when the trajectory's steps are labelled (None: the outcome's alone). ``navigated``:
    sampled with advice in its prompt (``Trajectory.experience_ids``)."""

    token_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]
    advantage: float
    temperature: float = 1.0
    proximal_logprobs: list[float] | None = None
    step_advantages: list[float] | None = None
    navigated: bool = False

    def after(self, start: int) -> Sample:
        """The part from token ``start`` on (what follows a shared prompt)."""
        proximal = self.proximal_logprobs
        steps = self.step_advantages
        return Sample(
            self.token_ids[start:],
            self.behaviour_logprobs[start:],
            self.loss_mask[start:],
            self.advantage,
            self.temperature,
            None if proximal is None else proximal[start:],
            None if steps is None else steps[start:],
            self.navigated,
        )


@dataclass(frozen=True)
class SampleBatch:
    """What ``build_samples`` kept (per group) and what it refused, counted by reason;
    ``step_credit`` counts the kept groups trained with step advantages."""

    groups: list[list[Sample]]
    uniform: int
    malformed: int
    truncated: int
    step_credit: int = 0


class GroupLayout(NamedTuple):
    """How one group runs through a forward/backward pass (``GrpoLearner.group_layout``)."""

    prompt_length: int  # the shared prompt, run once (0: none)
    micro_batch_size: int  # continuations scored together
    checkpointed: bool  # activation checkpointing (bounded memory, no shared prompt)
    # the shared prompt's graph is not kept but run again in chunks of this many tokens
    # in backward (``SharedPrefix``'s ``recompute_chunk``); None: kept
    prompt_chunk: int | None = None


class PaddedBatch(NamedTuple):
    """A right-padded micro-batch, ``[B, T]`` unless said otherwise."""

    ids: Tensor
    attention: Tensor
    loss_mask: Tensor
    behaviour: Tensor
    advantages: Tensor  # [B], or [B, T] when a sample has step advantages
    temperatures: Tensor  # [B]
    proximal: Tensor | None  # when every sample has them
    navigated: Tensor  # [B] bool: sampled with advice in the prompt


def malformed_reason(trajectory: Trajectory) -> str | None:
    n = len(trajectory.token_ids)
    if len(trajectory.logprobs) != n or len(trajectory.loss_mask) != n:
        return "token_ids, logprobs and loss_mask differ in length"
    if not any(trajectory.loss_mask):
        return "no generated tokens"
    if trajectory.loss_mask[0]:
        return "the first token cannot be scored"
    if not all(math.isfinite(x) for x in trajectory.logprobs):
        return "non-finite behaviour log-prob"
    return None


def truncation(trajectory: Trajectory) -> str | None:
    """How the trajectory's sampling distribution was truncated, if it was.

    The behaviour log-probs of a truncated distribution are not those of the full softmax
    the learner scores, so the ratios would be biased; such trajectories are refused.
    """
    if trajectory.temperature <= 0:
        return "greedy decoding (temperature 0)"
    if trajectory.top_p < 1.0:
        return f"top_p={trajectory.top_p}"
    if trajectory.top_k is not None and trajectory.top_k > 0:
        return f"top_k={trajectory.top_k}"
    return None


def pad_batch(samples: Sequence[Sample], pad_id: int, device: torch.device) -> PaddedBatch:
    """Right-pad a micro-batch (see ``PaddedBatch``)."""
    length = max(len(s.token_ids) for s in samples)
    shape = (len(samples), length)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.bool)
    behaviour = torch.zeros(shape, dtype=torch.float32)
    with_proximal = all(s.proximal_logprobs is not None for s in samples)
    proximal = torch.zeros(shape, dtype=torch.float32) if with_proximal else None
    for row, sample in enumerate(samples):
        n = len(sample.token_ids)
        ids[row, :n] = torch.tensor(sample.token_ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        behaviour[row, :n] = torch.tensor(sample.behaviour_logprobs)
        if proximal is not None and sample.proximal_logprobs is not None:
            proximal[row, :n] = torch.tensor(sample.proximal_logprobs)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    if any(s.step_advantages is not None for s in samples):
        steps = torch.zeros(shape, dtype=torch.float32)
        for row, sample in enumerate(samples):
            if sample.step_advantages is not None:
                steps[row, : len(sample.step_advantages)] = torch.tensor(sample.step_advantages)
        advantages = advantages[:, None] + steps
    temperatures = torch.tensor([s.temperature for s in samples], dtype=torch.float32)
    navigated = torch.tensor([s.navigated for s in samples], dtype=torch.bool)
    return PaddedBatch(
        ids.to(device),
        attention.to(device),
        mask.to(device),
        behaviour.to(device),
        advantages.to(device),
        temperatures.to(device),
        None if proximal is None else proximal.to(device),
        navigated.to(device),
    )


def weight_caps(navigated: Tensor, cap: float | None, navigated_cap: float) -> Tensor:
    """Each sequence's cap on its behaviour weights: ``navigated_cap`` for a navigated one,
    ``cap`` (None: none) for the others."""
    plain = math.inf if cap is None else cap
    return torch.where(
        navigated,
        torch.full_like(navigated, navigated_cap, dtype=torch.float32),
        torch.full_like(navigated, plain, dtype=torch.float32),
    )


def split_groups(grouped: Sequence[list[Sample]], parts: int) -> list[list[list[Sample]]]:
    """Whole groups dealt round-robin into at most ``parts`` non-empty mini-batches."""
    return [list(grouped[i::parts]) for i in range(min(parts, len(grouped)))]


class ObjectiveMismatch(ValueError):
    """A checkpoint trained with one objective, resumed under another."""


class GrpoLearner:
    def __init__(
        self,
        policy: LoadedPolicy,
        config: LearnerConfig | None = None,
        *,
        log_dir: Path | None = None,
    ) -> None:
        self.policy = policy
        self.model: nn.Module = policy.model
        self.config = config or LearnerConfig()
        self.device = torch.device(policy.device)
        self.step_count = 0
        self.version = 0
        # the SFT warm start finished and its policy is the KL reference (``freeze_reference``)
        self.warm_started = False
        # Dropout stays off: with it the ratio on on-policy data would not be 1 and the
        # clip would fire on noise. Gradients flow in eval mode all the same.
        self.model.eval()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the policy has no trainable parameters (finetune='none'?)")
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        self.frozen_reference: nn.Module | None = None
        if policy.finetune != "lora" and self.needs_reference:
            self.frozen_reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        pad_id = policy.tokenizer.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else policy.tokenizer.eos_token_id or 0)
        self.writer = SummaryWriter(str(log_dir)) if log_dir is not None else None
        self.warned_truncated = False
        # ground-truth examples replayed with every update (``set_demonstrations``)
        self.demonstrations: list[SftExample] = []
        # coevolving_dpo's failure agent (``preference.failure_agent``), made anew when the
        # warm start ends so that it starts as the target's fresh adapter
        self.failure_agent: FailureAgent | None = None
        if self.config.preference.failure_agent:
            self.failure_agent = FailureAgent(self)

    @property
    def needs_reference(self) -> bool:
        """Whether a step runs the reference: GRPO's KL term, or a preference objective."""
        return self.config.kl_beta > 0 or self.config.objective != "grpo"

    # ------------------------------------------------------------------ training

    def step(
        self, groups: Sequence[RolloutGroup], experts: Mapping[str, PairSide] | None = None
    ) -> StepMetrics:
        """The updates of one batch of ``groups``; returns its metrics (and logs them).

        Under a preference objective (``LearnerConfig.objective``) the groups become pairs
        (``preference.py``), ``experts`` giving the expert side of each task id that has
        one; GRPO ignores ``experts``."""
        if self.config.objective != "grpo":
            return preference_step(self, groups, experts or {})
        started = time.perf_counter()
        if any(g.agent != "target" for g in groups):
            log.warning("GRPO trains the target alone: the failure agent's groups are left out")
            groups = [g for g in groups if g.agent == "target"]
        kept, dropped = filter_stale(groups, self.version, self.config.max_staleness)
        batch = self.build_samples(kept)
        samples = [sample for group in batch.groups for sample in group]
        rewards = torch.tensor([r for g in kept for r in g.rewards()], dtype=torch.float32)
        staleness = [self.version - group_version(g) for g in kept]

        stats: list[GrpoStats] = []
        tokens = 0
        grad_norms: list[float] = []
        demo_losses: list[float] = []
        if samples:
            # under torch.distributed each rank takes a share (``distributed``); the token
            # normalisers stay those of the whole batch, so the summed gradient is the same
            if self.config.updates_per_step > 1:
                tokens += self.fill_proximal_logprobs(share(batch.groups))
            demos = self.draw_demonstrations(len(batch.groups))
            demo_tokens = sum(e.supervised_tokens for e in demos)
            for _ in range(self.config.ppo_epochs):
                for part in split_groups(batch.groups, self.config.mini_batches):
                    total = GradientSum(self.trainable)
                    part_trained = sum(sum(s.loss_mask) for group in part for s in group)
                    part_stats, part_tokens = self.accumulate_gradients(
                        share(part), part_trained, total.collect
                    )
                    stats.extend(part_stats)
                    tokens += part_tokens
                    if demos:
                        mine = share(self.demo_chunks(demos))
                        demo_losses.append(
                            self.accumulate_demo_gradients(mine, demo_tokens, total.collect)
                        )
                        tokens += sum(len(e.input_ids) for chunk in mine for e in chunk)
                    total.finish()
                    grad_norms.append(self.apply_update())
            if world()[1] > 1:
                stats = [s for rank_stats in gathered(stats) for s in rank_stats]
                tokens = sum(gathered(tokens))
                demo_losses = [sum(parts) for parts in zip(*gathered(demo_losses), strict=True)]
        updates = sum(math.isfinite(norm) for norm in grad_norms)
        if updates:
            self.step_count += 1
            self.version += 1
        duration = time.perf_counter() - started

        metrics = StepMetrics(
            step=self.step_count,
            version=self.version,
            trained=updates > 0,
            groups=len(kept),
            trajectories=len(samples),
            dropped_stale=dropped,
            uniform_groups=batch.uniform,
            malformed=batch.malformed,
            refused_truncated=batch.truncated,
            updates=updates,
            reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
            reward_std=float(rewards.std(correction=0)) if len(rewards) else 0.0,
            staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            **token_weighted_means(stats),
            grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            trained_tokens=sum(sum(s.loss_mask) for s in samples),
            tokens=tokens,
            tokens_per_s=tokens / duration if duration > 0 else 0.0,
            duration_s=duration,
            demo_loss=sum(demo_losses) / len(demo_losses) if demo_losses else 0.0,
            peak_rss_gb=peak_resident_gb(),
            step_credit_groups=batch.step_credit,
            label_s=sum(g.label_s for g in kept),
        )
        self.log_metrics(metrics)
        release_freed_memory()
        return metrics

    def apply_update(self) -> float:
        """Clip the accumulated gradient and step the optimizer; returns the norm before
        clipping. A non-finite norm skips the update (one overflow must not wipe weights)."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("non-finite gradient norm (%s); update skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def set_demonstrations(self, examples: Sequence[SftExample]) -> None:
        """The ground-truth examples replayed with every update (``demo_coef``)."""
        self.demonstrations = [e for e in examples if e.supervised_tokens > 0]

    def draw_demonstrations(self, groups: int | None = None) -> list[SftExample]:
        """This step's demonstrations, drawn by step number (so a resumed learner draws what
        it would have); none when replay is off. A step training fewer than
        ``groups_per_step`` groups replays that share of ``demo_examples`` (at least one):
        replay keeps its share of the compute however the groups arrive."""
        wanted = self.config.demo_examples
        if groups is not None and groups < self.config.groups_per_step:
            wanted = math.ceil(wanted * groups / self.config.groups_per_step)
        wanted = min(wanted, len(self.demonstrations))
        if self.config.demo_coef <= 0 or wanted == 0:
            return []
        drawn = random.Random(self.step_count).sample(self.demonstrations, wanted)
        # examples with the same prompt (tools) side by side share its forward pass
        return sorted(drawn, key=prompt_key)

    def demo_chunks(self, demos: Sequence[SftExample]) -> list[list[SftExample]]:
        """The demonstrations in micro-batches: the units dealt to ranks."""
        size = max(1, self.config.micro_batch_size)
        return [list(demos[start : start + size]) for start in range(0, len(demos), size)]

    def accumulate_demo_gradients(
        self,
        chunks: Sequence[Sequence[SftExample]],
        total_tokens: int,
        collect: Callable[[], None] | None = None,
    ) -> float:
        """Backpropagate ``demo_coef`` times the cross-entropy of the demonstrations in
        ``chunks`` over ``total_tokens`` (those of all this step's demonstrations), calling
        ``collect`` after each chunk; returns this share of the mean, unweighted."""
        coef = self.config.demo_coef
        weighted = 0.0
        for chunk in chunks:
            weighted += accumulate_sft_gradients(
                self.model,
                chunk,
                self.pad_id,
                self.device,
                total_tokens / coef,
                self.config.min_shared_prompt,
                self.config.activation_tokens,
            )
            if collect is not None:
                collect()
        return weighted / coef

    def build_samples(self, groups: Sequence[RolloutGroup]) -> SampleBatch:
        """Samples with their advantages, per group, and the refusals by reason."""
        grouped: list[list[Sample]] = []
        uniform = malformed = truncated = step_credit = 0
        for group in groups:
            factor = self.config.origin_advantage_scale.get(group.origin, 1.0)
            rewards = torch.tensor(group.rewards(), dtype=torch.float32)
            advantages = group_advantages(rewards, self.config.advantage_eps) * factor
            steps = self.step_values(group, factor)
            if self.config.drop_uniform_groups and not bool(advantages.any()) and steps is None:
                uniform += 1
                continue
            per_trajectory: Sequence[list[float] | None] = steps or [None] * len(group.trajectories)
            samples: list[Sample] = []
            for trajectory, advantage, values in zip(
                group.trajectories, advantages.tolist(), per_trajectory, strict=True
            ):
                reason = malformed_reason(trajectory)
                if reason is None and (how := truncation(trajectory)) is not None:
                    self.refuse_truncated(trajectory, how)
                    truncated += 1
                    continue
                sample = self.to_sample(trajectory, advantage, values)
                if reason is None and not any(sample.loss_mask):
                    reason = "cut before its first generated token"
                if reason is not None:
                    log.warning("skipping trajectory %s: %s", trajectory.id, reason)
                    malformed += 1
                    continue
                samples.append(sample)
            if samples:
                grouped.append(samples)
                step_credit += steps is not None
        return SampleBatch(grouped, uniform, malformed, truncated, step_credit)

    def step_values(self, group: RolloutGroup, factor: float = 1.0) -> list[list[float]] | None:
        """Each trajectory's step advantages (``grpo.step_advantages``, times the origin's
        ``factor``); None when they are all 0: no trajectory of the group has a label for
        each of its steps, the labels all agree, or ``step_credit_scale`` is 0. A
        trajectory whose labels do not fit is unlabelled."""
        if self.config.step_credit_scale == 0:
            return None
        fitting = [labels_fit(t) for t in group.trajectories]
        for trajectory, fits in zip(group.trajectories, fitting, strict=True):
            if trajectory.step_labels and not fits:
                log.warning(
                    "trajectory %s: %d step labels for %d steps; trained without them",
                    trajectory.id,
                    len(trajectory.step_labels),
                    len(step_spans(trajectory.loss_mask)),
                )
        if not any(fitting):
            return None
        labels = [
            list(t.step_labels) if fits else []
            for t, fits in zip(group.trajectories, fitting, strict=True)
        ]
        values = step_advantages(
            labels, self.config.step_credit_scale * factor, self.config.advantage_eps
        )
        return values if any(any(row) for row in values) else None

    def refuse_truncated(self, trajectory: Trajectory, how: str) -> None:
        """Say loudly, once per learner, why such trajectories are refused; then quietly."""
        if self.warned_truncated:
            log.debug("refusing trajectory %s sampled with %s", trajectory.id, how)
            return
        self.warned_truncated = True
        log.error(
            "refusing trajectory %s: sampled with %s, a truncated distribution whose "
            "behaviour log-probs the learner cannot reproduce; every such trajectory is "
            "refused (counted as refused_truncated). Sample with top_p 1.0, no top_k and "
            "temperature > 0 (services.rollout) for the learner to train.",
            trajectory.id,
            how,
        )

    def to_sample(
        self, trajectory: Trajectory, advantage: float, step_values: list[float] | None = None
    ) -> Sample:
        """The trajectory cut at ``max_tokens``; with ``step_values`` (one per step) each
        step's value on its tokens (``Sample.step_advantages``)."""
        limit = self.config.max_tokens or len(trajectory.token_ids)
        mask = trajectory.loss_mask[:limit]
        steps = None
        if step_values:
            spans = step_spans(trajectory.loss_mask)
            steps = step_token_advantages(spans, step_values, len(mask))
        return Sample(
            token_ids=trajectory.token_ids[:limit],
            behaviour_logprobs=trajectory.logprobs[:limit],
            loss_mask=mask,
            advantage=advantage,
            temperature=trajectory.temperature,
            step_advantages=steps,
            navigated=bool(trajectory.experience_ids),
        )

    def group_layout(self, group: Sequence[Sample]) -> GroupLayout:
        """How a group runs: its prompt once (``prompt_length``; 0: none) with micro-batches
        of continuations; one continuation at a time when a micro-batch would go over the
        activation budget; when even one beside the prompt would, the prompt's graph run
        again in chunks in backward; checkpointed without the shared prompt only when one
        continuation alone is over the budget."""
        prompt_length = 0
        if self.config.share_prompt and len(group) > 1:
            prompt_length = shared_prompt_length(
                [s.token_ids for s in group], [s.loss_mask for s in group]
            )
        if prompt_length < self.config.min_shared_prompt:
            prompt_length = 0
        budget = self.config.activation_tokens
        size = max(1, self.config.micro_batch_size)
        # the prompt kept (with micro-batches, then one continuation at a time), then kept
        # as keys/values only: a long multi-turn prompt holds one chunk's activations at a
        # time instead of running every trajectory whole, checkpointed
        layouts = [(True, size), (True, 1), (False, size), (False, 1)]
        for kept, tails in layouts if prompt_length else layouts[:1]:
            held = self.held_tokens(group, prompt_length, tails)
            if not over_budget(held if kept else held[1:], budget):
                return GroupLayout(prompt_length, tails, False, None if kept else budget)
        return GroupLayout(0, 1, checkpointed=True)

    @torch.no_grad()
    def fill_proximal_logprobs(self, grouped: Sequence[Sequence[Sample]]) -> int:
        """Score every sample under the current weights (no gradient), before the first
        update, into ``Sample.proximal_logprobs``; returns the tokens processed."""
        tokens = 0
        for group in grouped:
            layout = self.group_layout(group)
            prompt_length, size = layout.prompt_length, layout.micro_batch_size
            prompt: SharedPrefix | None = None
            if prompt_length:
                prompt_ids = torch.tensor(group[0].token_ids[:prompt_length], device=self.device)
                prompt = SharedPrefix(
                    self.model, prompt_ids, group[0].temperature, requires_grad=False
                )
                tokens += prompt_length
            for start in range(0, len(group), size):
                chunk = group[start : start + size]
                padded = pad_batch(
                    [s.after(prompt_length) for s in chunk], self.pad_id, self.device
                )
                tokens += int(padded.attention.sum())
                logprobs = self.policy_logprobs(padded, prompt, with_entropy=False)[0].cpu()
                for row, sample in enumerate(chunk):
                    tail = logprobs[row, : len(sample.token_ids) - prompt_length].tolist()
                    sample.proximal_logprobs = [0.0] * prompt_length + tail
        return tokens

    def policy_logprobs(
        self, padded: PaddedBatch, prompt: SharedPrefix | None, *, with_entropy: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """The policy's log-probs of a micro-batch, each row at its sampling temperature."""
        if prompt is not None:
            return prompt.logprobs(
                padded.ids,
                padded.attention,
                padded.loss_mask,
                with_entropy=with_entropy,
                temperature=padded.temperatures,
            )
        return sequence_logprobs(
            self.model,
            padded.ids,
            padded.attention,
            padded.temperatures,
            positions=padded.loss_mask,
            with_entropy=with_entropy,
        )

    def accumulate_gradients(
        self,
        grouped: Sequence[Sequence[Sample]],
        trained_tokens: int | None = None,
        collect: Callable[[], None] | None = None,
    ) -> tuple[list[GrpoStats], int]:
        """Forward/backward every micro-batch; the loss is a token mean over all of them
        (over ``trained_tokens`` when given: a rank's share of a larger batch).

        A group's shared prompt is run once (``SharedPrefix``) and its trajectories are
        scored as continuations of it; ``collect`` is called after each group. Returns the
        statistics and the tokens processed.
        """
        if trained_tokens is None:
            trained_tokens = sum(sum(s.loss_mask) for group in grouped for s in group)
        stats: list[GrpoStats] = []
        tokens = 0
        for group in grouped:
            layout = self.group_layout(group)
            with activation_checkpointing(self.model) if layout.checkpointed else nullcontext():
                group_stats, group_tokens = self.accumulate_group(
                    group,
                    layout.prompt_length,
                    trained_tokens,
                    layout.micro_batch_size,
                    prompt_chunk=layout.prompt_chunk,
                )
            stats.extend(group_stats)
            tokens += group_tokens
            if collect is not None:
                collect()
        return stats, tokens

    def held_tokens(
        self, group: Sequence[Sample], prompt_length: int, micro_batch_size: int | None = None
    ) -> list[int]:
        """Tokens whose activations are held at once: the shared prompt (kept until the
        group's end) and a padded micro-batch of continuations as long as the longest."""
        size = max(1, micro_batch_size or self.config.micro_batch_size)
        tails = sorted((len(s.token_ids) - prompt_length for s in group), reverse=True)
        return [prompt_length, padded_tokens(tails[:size])]

    def accumulate_group(
        self,
        group: Sequence[Sample],
        prompt_length: int,
        trained_tokens: int,
        micro_batch_size: int | None = None,
        prompt_chunk: int | None = None,
    ) -> tuple[list[GrpoStats], int]:
        policy_prompt: SharedPrefix | None = None
        reference_prompt: SharedPrefix | None = None
        tokens = 0
        if prompt_length:
            prompt = torch.tensor(group[0].token_ids[:prompt_length], device=self.device)
            temperature = group[0].temperature  # a default: each micro-batch passes its own
            policy_prompt = SharedPrefix(
                self.model, prompt, temperature, requires_grad=True, recompute_chunk=prompt_chunk
            )
            if self.config.kl_beta > 0:
                with self.reference_model() as reference_net:
                    reference_prompt = SharedPrefix(
                        reference_net, prompt, temperature, requires_grad=False
                    )
            # a prompt run again in chunks in backward is run twice
            runs = 2 if policy_prompt.chunks else 1
            tokens += runs * prompt_length
        ordered = sorted(
            (s.after(prompt_length) for s in group), key=lambda s: len(s.token_ids), reverse=True
        )
        size = max(1, micro_batch_size or self.config.micro_batch_size)
        stats: list[GrpoStats] = []
        for start in range(0, len(ordered), size):
            chunk = ordered[start : start + size]
            padded = pad_batch(chunk, self.pad_id, self.device)
            tokens += int(padded.attention.sum())
            logprobs, entropies = self.policy_logprobs(padded, policy_prompt)
            reference = self.reference_logprobs(
                padded.ids,
                padded.attention,
                padded.loss_mask,
                reference_prompt,
                padded.temperatures,
            )
            # one update per step: the proximal policy is the current one, this very pass
            proximal = padded.proximal if padded.proximal is not None else logprobs.detach()
            loss, chunk_stats = grpo_loss(
                logprobs,
                padded.behaviour,
                reference,
                padded.advantages,
                padded.loss_mask,
                self.config.clip_eps_low,
                self.config.clip_eps_high,
                self.config.kl_beta,
                proximal_logprobs=proximal,
                behaviour_weight_cap=weight_caps(
                    padded.navigated,
                    self.config.behaviour_weight_cap,
                    self.config.navigated_weight_cap,
                ),
                entropies=entropies,
                token_normalizer=trained_tokens,
            )
            loss.backward()
            stats.append(chunk_stats)
        if policy_prompt is not None:
            policy_prompt.backward()
        return stats, tokens

    def reference_logprobs(
        self,
        ids: Tensor,
        attention: Tensor,
        mask: Tensor,
        prompt: SharedPrefix | None,
        temperature: Tensor,
    ) -> Tensor | None:
        if self.config.kl_beta == 0:
            return None
        with torch.no_grad(), self.reference_model() as reference:
            if prompt is not None:
                logprobs, _ = prompt.logprobs(
                    ids, attention, mask, with_entropy=False, temperature=temperature
                )
            else:
                logprobs, _ = sequence_logprobs(
                    reference,
                    ids,
                    attention,
                    temperature,
                    positions=mask,
                    with_entropy=False,
                )
        return logprobs

    def reference_model(self) -> AbstractContextManager[nn.Module]:
        if self.frozen_reference is not None:
            return nullcontext(self.frozen_reference)
        reference: AbstractContextManager[nn.Module] = self.policy.reference()
        return reference

    def freeze_reference(self) -> None:
        """Make the policy as it stands (after the warm start) the KL reference.

        LoRA: its adapter becomes the frozen reference adapter and GRPO trains a fresh one
        (``adapters``); full fine-tuning: a frozen copy of the current weights.
        """
        if self.policy.finetune == "lora":
            freeze_trained_as_reference(self.model)
        elif self.frozen_reference is not None:
            self.frozen_reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer.state.clear()
        self.warm_started = True
        self.restart_failure_agent()

    def restart_failure_agent(self) -> None:
        """The failure agent (when on) starts again as the target's adapter as it stands:
        at the end of a warm start, both agents are the warm-started policy."""
        if self.failure_agent is not None:
            self.failure_agent = FailureAgent(self)

    # ------------------------------------------------------------------ outputs

    def log_metrics(self, metrics: StepMetrics) -> None:
        if metrics.trained and metrics.preference:
            self._log_preference_step(metrics)
        elif metrics.trained:
            self._log_step(metrics)
        else:  # the step count and version stay: no "step" line for a batch without one
            log.info(
                "no update at v%d: %d groups (%d uniform, %d stale), %d malformed, %d refused",
                metrics.version,
                metrics.groups + metrics.dropped_stale,
                metrics.uniform_groups,
                metrics.dropped_stale,
                metrics.malformed,
                metrics.refused_truncated,
            )
        if self.writer is None:
            return
        for name, value in metrics.scalars().items():
            if name == "kl" and self.config.kl_beta == 0:
                continue  # no reference pass, so no KL: a 0 would read as a measured one
            self.writer.add_scalar(f"learner/{name}", value, metrics.step)
        self.writer.flush()

    @staticmethod
    def _log_step(metrics: StepMetrics) -> None:
        log.info(
            "step %d v%d reward %.3f kl %.4f clip %.3f behaviour weight %.3f (max %.3g, "
            "capped %.3f) tokens/s %.0f dropped %d refused %d+%d peak resident %.1f GB",
            metrics.step,
            metrics.version,
            metrics.reward_mean,
            metrics.kl,
            metrics.clip_fraction,
            metrics.behaviour_weight_mean,
            metrics.behaviour_weight_max,
            metrics.behaviour_capped,
            metrics.tokens_per_s,
            metrics.dropped_stale,
            metrics.malformed,
            metrics.refused_truncated,
            metrics.peak_rss_gb,
        )

    def _log_preference_step(self, metrics: StepMetrics) -> None:
        if metrics.failure_agent:
            log.info(
                "failure agent v%d: %d pairs dpo %.4f accuracy %.3f; failures' reward "
                "%.3f (failure agent, %d groups) vs %.3f (target)",
                metrics.failure_agent_version,
                metrics.failure_agent_pairs,
                metrics.failure_agent_loss,
                metrics.failure_agent_accuracy,
                metrics.hard_negative_reward,
                metrics.failure_agent_groups,
                metrics.target_failure_reward,
            )
        log.info(
            "step %d v%d %s: %d pairs (%d failure vs failure) dpo %.4f sft %.4f "
            "accuracy %.3f margin %.4f reward %.3f tokens/s %.0f dropped %d",
            metrics.step,
            metrics.version,
            self.config.objective,
            metrics.pairs,
            metrics.failure_pairs,
            metrics.preference_loss,
            metrics.sft_loss,
            metrics.preference_accuracy,
            metrics.preference_margin,
            metrics.reward_mean,
            metrics.tokens_per_s,
            metrics.dropped_stale,
        )

    def export_weights(self) -> bytes:
        """The current trainable weights as safetensors bytes, for the rollout workers."""
        return export_weights(self.model)

    def save_checkpoint(self, path: Path) -> None:
        save_checkpoint(
            path,
            self.model,
            self.optimizer,
            self.step_count,
            self.version,
            extra={
                "model": self.policy.name,
                "config": msgspec.to_builtins(self.config),
                "warm_started": self.warm_started,
                "objective": self.config.objective,
                **(
                    {"failure_agent": self.failure_agent.state()}
                    if self.failure_agent is not None
                    else {}
                ),
            },
        )

    def restore_checkpoint(self, path: Path) -> None:
        """Resume from ``path``: weights, optimizer, counters. A checkpoint trained with
        another objective is refused (checkpoints from before objectives were recorded
        are GRPO's)."""
        state = load_checkpoint(path, self.model, self.optimizer, check=self.check_objective)
        self.apply_optimizer_settings()
        self.step_count = state.step
        self.version = state.version
        self.warm_started = bool(state.extra.get("warm_started", False))
        saved_agent = state.extra.get("failure_agent")
        if self.failure_agent is not None and saved_agent is not None:
            self.failure_agent.restore(saved_agent)
        else:
            # switched on for a run that had none: it starts from the target as it stands
            self.restart_failure_agent()
        if self.warm_started and self.policy.finetune != "lora" and self.needs_reference:
            # the frozen copy is not in the checkpoint: the closest reference is the policy
            log.warning("full fine-tuning resumed: the KL reference restarts from these weights")
            self.frozen_reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    def check_objective(self, path: Path, extra: Mapping[str, Any]) -> None:
        saved = extra.get("objective", "grpo")
        if saved != self.config.objective:
            raise ObjectiveMismatch(
                f"{path} was trained with objective {saved!r}, but learner.grpo.objective is "
                f"{self.config.objective!r}: resume with objective {saved!r}, or start a new "
                "run directory for the other objective"
            )

    def apply_optimizer_settings(self) -> None:
        """The configured lr, betas and weight decay on every parameter group: a restored
        optimizer state carries the settings it was saved with, and the configuration wins
        (a run resumed or started from another run's checkpoint with a new ``lr``)."""
        wanted = {
            "lr": self.config.lr,
            "betas": tuple(self.config.betas),
            "weight_decay": self.config.weight_decay,
        }
        for group in self.optimizer.param_groups:
            current = {**group, "betas": tuple(group["betas"])}
            changed = {k: (current[k], v) for k, v in wanted.items() if current[k] != v}
            if changed:
                log.info("optimizer settings from the configuration: %s", changed)
            group.update(wanted)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


MEAN_STATISTICS = (
    "loss",
    "policy_loss",
    "kl",
    "clip_fraction",
    "ratio_mean",
    "behaviour_weight_mean",
    "behaviour_capped",
    "entropy",
)


def token_weighted_means(stats: Sequence[GrpoStats]) -> dict[str, Any]:
    """Micro-batch statistics combined into means over all trained tokens (and the
    largest behaviour weight)."""
    total = sum(s.tokens for s in stats)
    if total == 0:
        return {name: 0.0 for name in MEAN_STATISTICS} | {"behaviour_weight_max": 0.0}

    def mean(name: str) -> float:
        return sum(float(getattr(s, name) or 0.0) * s.tokens for s in stats) / total

    means = {name: mean(name) for name in MEAN_STATISTICS}
    return means | {"behaviour_weight_max": max(s.behaviour_weight_max for s in stats if s.tokens)}
