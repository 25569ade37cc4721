"""What one learner step did (``StepMetrics``), whichever objective made it: GRPO's step
(``trainer``) and a preference objective's (``preference``) report the same record."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepMetrics:
    """What one ``step`` did. Means are over the trained (generated) tokens of every
    update (see ``GrpoStats``)."""

    step: int
    version: int  # the policy version after the step
    # False when nothing was left to train on, or the update was skipped for a non-finite
    # gradient
    trained: bool
    groups: int
    trajectories: int
    dropped_stale: int  # groups beyond the staleness bound
    uniform_groups: int  # groups with equal rewards: no signal, skipped
    malformed: int  # trajectories refused as broken
    # trajectories sampled from a truncated distribution (top_p < 1, top_k, greedy), which
    # the learner does not score
    refused_truncated: int
    updates: int  # optimizer updates applied
    reward_mean: float
    reward_std: float
    staleness_mean: float
    staleness_max: int
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    behaviour_weight_mean: float
    behaviour_weight_max: float  # a max, not a mean
    behaviour_capped: float
    entropy: float
    grad_norm: float  # mean over the updates, before clipping
    trained_tokens: int  # the trained tokens, each once
    # every token run through the policy: a shared prompt once per pass, the proximal pass
    # included
    tokens: int
    tokens_per_s: float  # tokens over the step's wall time
    duration_s: float
    # mean cross-entropy per token of the replayed demonstrations (0: none replayed; see
    # LearnerConfig.demo_coef)
    demo_loss: float = 0.0
    # the process's resident-memory high-water mark so far, in GB (the step's own peak
    # when it is the largest yet)
    peak_rss_gb: float = 0.0
    # groups trained with a step advantage (rollout.step_credit), and the attributor's
    # seconds on this step's groups (RolloutGroup.label_s, failed tries included)
    step_credit_groups: int = 0
    label_s: float = 0.0
    # a preference objective's step (``LearnerConfig.objective`` eto or coevolving_dpo;
    # ``preference.py``): its pairs, of which failure-vs-failure ones; DPO's loss (also in
    # ``policy_loss``; ``loss`` adds sft_coef x ``sft_loss``), the expert's NLL per token,
    # the share of pairs whose margin is positive, the mean margin and DPO's implicit
    # rewards β·(π - ref) of the chosen and rejected sides. Left out of ``scalars`` under GRPO
    preference: bool = False
    pairs: int = 0
    failure_pairs: int = 0
    preference_loss: float = 0.0
    sft_loss: float = 0.0
    preference_accuracy: float = 0.0
    preference_margin: float = 0.0
    chosen_reward: float = 0.0
    rejected_reward: float = 0.0
    # coevolving_dpo with the failure agent (``failure_agent.py``): its version after the
    # step, its pairs, DPO loss and accuracy, the step's groups it rolled, and the mean
    # reward of its failures (the hard negatives) and of the target's. Left out without it
    failure_agent: bool = False
    failure_agent_version: int = 0
    failure_agent_pairs: int = 0
    failure_agent_loss: float = 0.0
    failure_agent_accuracy: float = 0.0
    failure_agent_groups: int = 0
    hard_negative_reward: float = 0.0
    target_failure_reward: float = 0.0

    def scalars(self) -> dict[str, float]:
        left_out = {"step", "version", "preference", "failure_agent"}
        if not self.preference:
            left_out |= set(PREFERENCE_METRICS)
        if not self.failure_agent:
            left_out |= set(FAILURE_AGENT_METRICS)
        return {k: float(v) for k, v in asdict(self).items() if k not in left_out}


# the StepMetrics fields only a preference objective's step fills in
PREFERENCE_METRICS = (
    "pairs",
    "failure_pairs",
    "preference_loss",
    "sft_loss",
    "preference_accuracy",
    "preference_margin",
    "chosen_reward",
    "rejected_reward",
)
# the StepMetrics fields only a step with the failure agent fills in
FAILURE_AGENT_METRICS = (
    "failure_agent_version",
    "failure_agent_pairs",
    "failure_agent_loss",
    "failure_agent_accuracy",
    "failure_agent_groups",
    "hard_negative_reward",
    "target_failure_reward",
)
