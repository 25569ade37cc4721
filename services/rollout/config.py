"""Rollout's settings (the ``services.rollout`` section)."""

from __future__ import annotations

import msgspec

from coevolve.shared.config import EngineKind
from coevolve.shared.toolcalls import CLOSE_TAG


class StepCreditConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Self-attributing (``rollout.step_credit``): before a group is published, the
    attributor LLM role labels each step of each trajectory GOOD or BAD; the learner adds
    a step advantage (``learner.grpo.step_credit_scale``). Off: unmeasured here."""

    enabled: bool = False
    # a group whose rewards are all equal has no outcome advantage: its steps' labels are
    # the only gradient it can give
    label_uniform_groups: bool = True
    # the group is published unlabelled when labelling takes longer
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"rollout.step_credit.timeout_s must be > 0, got {self.timeout_s}")


class NavigationConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Self-navigating (``rollout.navigation``): when a job carries experiences (the
    distiller runs and pool-store found some like the task), this share of the group's
    episodes is sampled with them in the prompt; the learner trains on those without the
    advice (``learner.grpo.navigated_weight_cap``)."""

    share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"rollout.navigation.share must be in [0, 1], got {self.share}")

    def guided(self, group_size: int) -> int:
        """Episodes of a group of ``group_size`` that get the advice."""
        return round(self.share * group_size)


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    # llama_cpp: the CPU engine (a float GGUF base, each policy version as a LoRA adapter);
    # transformers: torch + peft in process; vllm: GPUs
    engine: EngineKind = "llama_cpp"
    device: str | None = None
    # CPU threads of the llama_cpp engine (None: torch's, i.e. OMP_NUM_THREADS)
    threads: int | None = None
    # two BFCL calls in one message take ~100 tokens; a cut call scores 0
    max_new_tokens: int = 128
    # an unsolved episode's reward: this times its share of matched ground-truth calls
    # (0: BFCL's 0/1 only). A policy that solves nothing yet still gets a gradient; kept
    # under the signal threshold (0.5), so a reward above it still means solved
    partial_credit: float = 0.4
    temperature: float = 1.0
    top_p: float = 1.0
    # a message ends once one of these is in its text: the agent makes one call a message,
    # and nothing after a call's closing tag acts before the tool answers
    stop: list[str] = msgspec.field(default_factory=lambda: [CLOSE_TAG])
    # assistant messages an episode may take per user turn: one per call and the closing
    # reply (the warm start's format), so a per-turn task gets 4 (94% of BFCL's base turns
    # have at most 3 calls) and a 4-turn entry 16 ...
    max_steps_per_turn: int = 4
    # ... and at most this many in all (None: no cap beyond the per-turn budget)
    max_steps: int | None = None
    # groups published and not yet taken by the learner before rollout waits: two steps'
    # worth (learner.grpo.groups_per_step 2), so no group waits past the staleness bound
    # and a waiting rollout leaves its core to the data loop
    max_unconsumed_groups: int = 4
    # ... except while the learner holds its step for the data loop (``pacing``): its
    # policy does not change then, so the groups stay on-policy, and their failures are
    # the signals the loop needs to catch up. With 4, a run with no labels held the
    # learner 300 s while rollout waited too and the loop made nothing; with 8 it stopped
    # again at 9 (4 taken by the waiting learner, 5 queued) for 275 s of a wait. 16: a
    # whole max_wait_s of groups at about 30 s each, beside what the learner holds
    max_unconsumed_groups_while_learner_waits: int = 16
    backpressure_poll_s: float = 0.5
    # take no job before the learner's first announced policy (its warm start): the base
    # model calls no tool, so its groups all score 0 and only take CPU from the warm start
    wait_for_policy: bool = True
    step_credit: StepCreditConfig = msgspec.field(default_factory=StepCreditConfig)
    navigation: NavigationConfig = msgspec.field(default_factory=NavigationConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.partial_credit < 1.0:
            raise ValueError(f"rollout.partial_credit must be in [0, 1), got {self.partial_credit}")
