"""The GRPO learner: turns batches of rollout groups into optimizer steps.

One ``step`` takes the groups gathered since the last one, drops those older than the
staleness bound, computes group-relative advantages, runs the policy (and the reference,
for the KL term) over the trajectories in micro-batches with gradient accumulation, clips
the gradient norm and applies one AdamW update. Each step makes a new policy version.

The reference policy is the base model: with LoRA (the default) it is the same network
with its adapters switched off, so it costs no memory; under full fine-tuning a frozen copy
of the starting weights is kept (only when the KL term is on).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from coevolve.services.learner.checkpoint import load_checkpoint, save_checkpoint
from coevolve.services.learner.grpo import (
    GrpoStats,
    SharedPrefix,
    filter_stale,
    group_advantages,
    group_version,
    grpo_loss,
    sequence_logprobs,
    shared_prompt_length,
)
from coevolve.services.learner.memory import (
    DEFAULT_ACTIVATION_TOKENS,
    activation_checkpointing,
    over_budget,
)
from coevolve.shared.messages import RolloutGroup, Trajectory
from coevolve.shared.policy import LoadedPolicy, export_weights

log = logging.getLogger(__name__)


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Learner settings (the ``services.learner`` section of the run configuration)."""

    lr: float = 5e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_beta: float = 0.001
    max_grad_norm: float = 1.0
    micro_batch_size: int = 2
    max_staleness: int = 4
    # must equal the rollout's sampling temperature, or the ratios are biased
    temperature: float = 1.0
    advantage_eps: float = 1e-6
    # a group whose rewards are all equal has zero advantage: skip its compute (DAPO)
    drop_uniform_groups: bool = True
    # sequences longer than this are cut (their later tokens are not trained); None: no cut
    max_tokens: int | None = None
    # run a group's common prompt once and score the trajectories as its continuations
    share_prompt: bool = True
    # a group with more tokens than this runs one trajectory at a time with activation
    # checkpointing (bounded memory, no prompt sharing); None: never
    activation_tokens: int | None = DEFAULT_ACTIVATION_TOKENS
    min_shared_prompt: int = 16
    # how many groups the learner service gathers for one step
    groups_per_step: int = 4


@dataclass(frozen=True)
class StepMetrics:
    """What one ``step`` did.

    ``trained`` is False when nothing was left to train on (or the update was skipped for
    a non-finite gradient); ``version`` is the policy version after the step.
    ``dropped_stale``: groups beyond the staleness bound; ``uniform_groups``: groups with
    equal rewards (no signal, skipped); ``malformed``: trajectories refused.
    ``loss``..``entropy`` are means over the trained (generated) tokens; ``trained_tokens``
    counts those, ``tokens`` every token run through the policy (a shared prompt once), and
    ``tokens_per_s`` is ``tokens`` over the step's wall time.
    """

    step: int
    version: int
    trained: bool
    groups: int
    trajectories: int
    dropped_stale: int
    uniform_groups: int
    malformed: int
    reward_mean: float
    reward_std: float
    staleness_mean: float
    staleness_max: int
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    entropy: float
    grad_norm: float
    trained_tokens: int
    tokens: int
    tokens_per_s: float
    duration_s: float

    def scalars(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if k not in ("step", "version")}


@dataclass
class Sample:
    token_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]
    advantage: float

    def after(self, start: int) -> Sample:
        """The part from token ``start`` on (what follows a shared prompt)."""
        return Sample(
            self.token_ids[start:],
            self.behaviour_logprobs[start:],
            self.loss_mask[start:],
            self.advantage,
        )


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


def pad_batch(
    samples: Sequence[Sample], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Right-pad a micro-batch: ids, attention mask, loss mask, behaviour log-probs, adv."""
    length = max(len(s.token_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.bool)
    behaviour = torch.zeros((len(samples), length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.token_ids)
        ids[row, :n] = torch.tensor(sample.token_ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        behaviour[row, :n] = torch.tensor(sample.behaviour_logprobs)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return (
        ids.to(device),
        attention.to(device),
        mask.to(device),
        behaviour.to(device),
        advantages.to(device),
    )


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
        if policy.finetune != "lora" and self.config.kl_beta > 0:
            self.frozen_reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        pad_id = policy.tokenizer.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else policy.tokenizer.eos_token_id or 0)
        self.writer = SummaryWriter(str(log_dir)) if log_dir is not None else None

    # ------------------------------------------------------------------ training

    def step(self, groups: Sequence[RolloutGroup]) -> StepMetrics:
        """One optimizer step on ``groups``; returns its metrics (and logs them)."""
        started = time.perf_counter()
        kept, dropped = filter_stale(groups, self.version, self.config.max_staleness)
        grouped, uniform, malformed = self.build_samples(kept)
        samples = [sample for group in grouped for sample in group]
        rewards = torch.tensor([r for g in kept for r in g.rewards()], dtype=torch.float32)
        staleness = [self.version - group_version(g) for g in kept]

        stats: list[GrpoStats] = []
        tokens = 0
        grad_norm = 0.0
        trained = False
        if samples:
            stats, tokens = self.accumulate_gradients(grouped)
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.trainable, self.config.max_grad_norm)
            )
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.step_count += 1
                self.version += 1
                trained = True
            else:
                # One overflowing ratio must not wipe the weights: skip this update.
                log.warning("non-finite gradient norm (%s); update skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        duration = time.perf_counter() - started

        metrics = StepMetrics(
            step=self.step_count,
            version=self.version,
            trained=trained,
            groups=len(kept),
            trajectories=len(samples),
            dropped_stale=dropped,
            uniform_groups=uniform,
            malformed=malformed,
            reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
            reward_std=float(rewards.std(correction=0)) if len(rewards) else 0.0,
            staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            **token_weighted_means(stats),
            grad_norm=grad_norm,
            tokens=tokens,
            tokens_per_s=tokens / duration if duration > 0 else 0.0,
            duration_s=duration,
        )
        self.log_metrics(metrics)
        return metrics

    def build_samples(self, groups: Sequence[RolloutGroup]) -> tuple[list[list[Sample]], int, int]:
        """Samples with their advantages, per group; also the uniform and malformed counts."""
        grouped: list[list[Sample]] = []
        uniform = malformed = 0
        for group in groups:
            advantages = group_advantages(
                torch.tensor(group.rewards(), dtype=torch.float32), self.config.advantage_eps
            )
            if self.config.drop_uniform_groups and not bool(advantages.any()):
                uniform += 1
                continue
            samples: list[Sample] = []
            for trajectory, advantage in zip(group.trajectories, advantages.tolist(), strict=True):
                reason = malformed_reason(trajectory)
                if reason is None and trajectory.temperature != self.config.temperature:
                    reason = (
                        f"sampled at temperature {trajectory.temperature}, the learner scores "
                        f"at {self.config.temperature}: the ratio would be biased"
                    )
                sample = self.to_sample(trajectory, advantage)
                if reason is None and not any(sample.loss_mask):
                    reason = "cut before its first generated token"
                if reason is not None:
                    log.warning("skipping trajectory %s: %s", trajectory.id, reason)
                    malformed += 1
                    continue
                samples.append(sample)
            if samples:
                grouped.append(samples)
        return grouped, uniform, malformed

    def to_sample(self, trajectory: Trajectory, advantage: float) -> Sample:
        limit = self.config.max_tokens or len(trajectory.token_ids)
        return Sample(
            token_ids=trajectory.token_ids[:limit],
            behaviour_logprobs=trajectory.logprobs[:limit],
            loss_mask=trajectory.loss_mask[:limit],
            advantage=advantage,
        )

    def accumulate_gradients(
        self, grouped: Sequence[Sequence[Sample]]
    ) -> tuple[list[GrpoStats], int]:
        """Forward/backward every micro-batch; the loss is a token mean over all of them.

        A group's shared prompt is run once (``SharedPrefix``) and its trajectories are
        scored as continuations of it; returns the statistics and the tokens processed.
        """
        trained_tokens = sum(sum(s.loss_mask) for group in grouped for s in group)
        stats: list[GrpoStats] = []
        tokens = 0
        for group in grouped:
            prompt_length = 0
            if self.config.share_prompt and len(group) > 1:
                prompt_length = shared_prompt_length(
                    [s.token_ids for s in group], [s.loss_mask for s in group]
                )
            if prompt_length < self.config.min_shared_prompt:
                prompt_length = 0
            if over_budget(self.held_tokens(group, prompt_length), self.config.activation_tokens):
                with activation_checkpointing(self.model):
                    group_stats, group_tokens = self.accumulate_group(
                        group, 0, trained_tokens, micro_batch_size=1
                    )
            else:
                group_stats, group_tokens = self.accumulate_group(
                    group, prompt_length, trained_tokens
                )
            stats.extend(group_stats)
            tokens += group_tokens
        return stats, tokens

    def held_tokens(self, group: Sequence[Sample], prompt_length: int) -> list[int]:
        """Tokens whose activations are held at once: the shared prompt (kept until the
        group's end) and the largest micro-batch of continuations."""
        tails = sorted((len(s.token_ids) - prompt_length for s in group), reverse=True)
        return [prompt_length, *tails[: max(1, self.config.micro_batch_size)]]

    def accumulate_group(
        self,
        group: Sequence[Sample],
        prompt_length: int,
        trained_tokens: int,
        micro_batch_size: int | None = None,
    ) -> tuple[list[GrpoStats], int]:
        policy_prompt: SharedPrefix | None = None
        reference_prompt: SharedPrefix | None = None
        tokens = 0
        if prompt_length:
            prompt = torch.tensor(group[0].token_ids[:prompt_length], device=self.device)
            policy_prompt = SharedPrefix(
                self.model, prompt, self.config.temperature, requires_grad=True
            )
            if self.config.kl_beta > 0:
                with self.reference_model() as reference_net:
                    reference_prompt = SharedPrefix(
                        reference_net, prompt, self.config.temperature, requires_grad=False
                    )
            tokens += prompt_length
        ordered = sorted(
            (s.after(prompt_length) for s in group), key=lambda s: len(s.token_ids), reverse=True
        )
        size = max(1, micro_batch_size or self.config.micro_batch_size)
        stats: list[GrpoStats] = []
        for start in range(0, len(ordered), size):
            chunk = ordered[start : start + size]
            ids, attention, mask, behaviour, advantages = pad_batch(chunk, self.pad_id, self.device)
            tokens += int(attention.sum())
            if policy_prompt is not None:
                logprobs, entropies = policy_prompt.logprobs(ids, attention, mask)
            else:
                logprobs, entropies = sequence_logprobs(
                    self.model, ids, attention, self.config.temperature, positions=mask
                )
            reference = self.reference_logprobs(ids, attention, mask, reference_prompt)
            loss, chunk_stats = grpo_loss(
                logprobs,
                behaviour,
                reference,
                advantages,
                mask,
                self.config.clip_eps_low,
                self.config.clip_eps_high,
                self.config.kl_beta,
                entropies=entropies,
                token_normalizer=trained_tokens,
            )
            loss.backward()
            stats.append(chunk_stats)
        if policy_prompt is not None:
            policy_prompt.backward()
        return stats, tokens

    def reference_logprobs(
        self, ids: Tensor, attention: Tensor, mask: Tensor, prompt: SharedPrefix | None
    ) -> Tensor | None:
        if self.config.kl_beta == 0:
            return None
        with torch.no_grad(), self.reference_model() as reference:
            if prompt is not None:
                logprobs, _ = prompt.logprobs(ids, attention, mask, with_entropy=False)
            else:
                logprobs, _ = sequence_logprobs(
                    reference,
                    ids,
                    attention,
                    self.config.temperature,
                    positions=mask,
                    with_entropy=False,
                )
        return logprobs

    def reference_model(self) -> AbstractContextManager[nn.Module]:
        if self.frozen_reference is not None:
            return nullcontext(self.frozen_reference)
        reference: AbstractContextManager[nn.Module] = self.policy.reference()
        return reference

    # ------------------------------------------------------------------ outputs

    def log_metrics(self, metrics: StepMetrics) -> None:
        log.info(
            "step %d v%d reward %.3f kl %.4f clip %.3f tokens/s %.0f dropped %d",
            metrics.step,
            metrics.version,
            metrics.reward_mean,
            metrics.kl,
            metrics.clip_fraction,
            metrics.tokens_per_s,
            metrics.dropped_stale,
        )
        if self.writer is None:
            return
        for name, value in metrics.scalars().items():
            self.writer.add_scalar(f"learner/{name}", value, metrics.step)
        self.writer.flush()

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
            extra={"model": self.policy.name, "config": msgspec.to_builtins(self.config)},
        )

    def restore_checkpoint(self, path: Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step_count = state.step
        self.version = state.version

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def token_weighted_means(stats: Sequence[GrpoStats]) -> dict[str, Any]:
    """Micro-batch statistics combined into means over all trained tokens."""
    total = sum(s.tokens for s in stats)
    if total == 0:
        zero = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        return {**zero, "ratio_mean": 0.0, "entropy": 0.0, "trained_tokens": 0}

    def mean(name: str) -> float:
        return sum(float(getattr(s, name) or 0.0) * s.tokens for s in stats) / total

    return {
        "loss": mean("loss"),
        "policy_loss": mean("policy_loss"),
        "kl": mean("kl"),
        "clip_fraction": mean("clip_fraction"),
        "ratio_mean": mean("ratio_mean"),
        "entropy": mean("entropy"),
        "trained_tokens": total,
    }
