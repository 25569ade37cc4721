"""The learner's settings: the trainer's (``grpo``, with the objective it optimises and the
preference objectives' own), the warm start's and the service's (the ``services.learner``
section)."""

from __future__ import annotations

from typing import Literal

import msgspec

# Tokens of one micro-batch run with stored activations (measured: autograd keeps 2.6 MB per
# token for the default model, so ~5.3 GB here): a per-turn BFCL example with the compact
# tool list (median ~1.1k tokens) and a shared-prompt micro-batch of them stay under it.
DEFAULT_ACTIVATION_TOKENS = 2048

Objective = Literal["grpo", "eto", "coevolving_dpo"]
OBJECTIVES: tuple[Objective, ...] = ("grpo", "eto", "coevolving_dpo")


class PreferenceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The preference objectives' settings (``services.learner.grpo.preference``; used only
    when ``objective`` is not ``grpo``). Unmeasured here: no run has compared them."""

    # DPO's beta: how far the policy may move from the reference to separate a pair
    beta: float = 0.1
    # weight of the expert's NLL (TRL's loss_type ["sigmoid", "sft"] weight; rpo_alpha):
    # the paper's supervised term for stability, about 0.5/0.5 with DPO (second-hand)
    sft_coef: float = 1.0
    # coevolving_dpo: at most this many failure-vs-failure pairs per group, the widest
    # reward gaps first
    failure_pairs_per_group: int = 4
    # coevolving_dpo: train the failure agent (``failure_agent.py``), a second adapter, on
    # those pairs (both agents' failures of a task), and give the target the expert
    # against both agents' failures instead. Its jobs come from pool-store
    # (``pool_store.failure_agent_share``, which must be above 0 with it)
    failure_agent: bool = False

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"learner.grpo.preference.beta must be > 0, got {self.beta}")
        if self.sft_coef < 0:
            raise ValueError(f"learner.grpo.preference.sft_coef must be >= 0, got {self.sft_coef}")
        if self.failure_pairs_per_group < 0:
            raise ValueError("learner.grpo.preference.failure_pairs_per_group must be >= 0")


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The trainer's settings (``services.learner.grpo``): GRPO's, and which objective a
    step optimises."""

    # grpo: the GRPO objective below. eto: DPO of the task's replayed ground truth
    # (chosen) against the step's failed trajectories (rejected) plus the expert's NLL;
    # coevolving_dpo: eto's pairs plus failure-vs-failure pairs ordered by partial credit
    # (a stand-in for the failure agent's hard negatives). See ``preference``
    objective: Objective = "grpo"
    preference: PreferenceConfig = msgspec.field(default_factory=PreferenceConfig)

    # a fresh adapter on top of the warm start: at 5e-5 a run's 1-4 steps moved KL below
    # 2e-4 and no greedy decision; 3e-4 is where bench/short_tasks.py's GRPO did learn
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    # 0 skips the reference forward pass, which at 0.001 bought a KL term of ~2e-7 and at
    # 0.01 cost more learning per wall minute than it gave (docs/learning-results.md);
    # the trust region is the clip
    kl_beta: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 2
    max_staleness: int = 4
    # decoupled PPO: each token's weight π_prox/π_behaviour is truncated at this (None: no cap)
    behaviour_weight_cap: float | None = 5.0
    # a navigated trajectory (rollout.navigation) was sampled with advice in its prompt and
    # is trained without it: its tokens' weight π_prox(a|s)/π_behaviour(a|s, advice) is
    # truncated at this instead (grpo.py says why 1)
    navigated_weight_cap: float = 1.0
    # optimizer updates per step: ppo_epochs passes over the batch, each split in
    # mini_batches parts of whole groups (1 and 1: one update, no extra forward pass)
    ppo_epochs: int = 1
    mini_batches: int = 1
    advantage_eps: float = 1e-6
    # the advantages of a group whose task has this origin are multiplied by the factor
    # (AgentEvolver halves synthetic tasks' advantages: {synthesized: 0.5}); empty: none
    # scaled. Not measured here yet: no default run has trained on enough synthesized
    # tasks to compare, so it stays off
    origin_advantage_scale: dict[str, float] = msgspec.field(default_factory=dict)
    # step credit (rollout.step_credit): a labelled step's advantage, scale times its label
    # standardised within the group, joins the outcome's on that step's tokens (grpo.py).
    # Used only when trajectories carry step labels; unmeasured here
    step_credit_scale: float = 0.2
    # a group whose rewards are all equal has zero advantage: skip its compute (DAPO); one
    # whose steps carry differing labels has a step advantage and is kept
    drop_uniform_groups: bool = True
    # sequences longer than this are cut (their later tokens are not trained); None: no cut
    max_tokens: int | None = None
    # run a group's common prompt once and score the trajectories as its continuations
    share_prompt: bool = True
    # a group with more tokens than this runs one trajectory at a time with activation
    # checkpointing (bounded memory, no prompt sharing); None: never
    activation_tokens: int | None = DEFAULT_ACTIVATION_TOKENS
    min_shared_prompt: int = 16
    # how many groups the learner service gathers for one step: 2 made 7 steps and 38
    # groups in 20 minutes against 4's 4 and 28, no measure significantly worse and the
    # ground truth's likelihood better (docs/learning-results.md, the sweep)
    groups_per_step: int = 2
    # demonstration replay (as PPO-ptx mixes in its pretraining loss): every update also
    # lowers the cross-entropy of ``demo_examples`` ground-truth examples of seed tasks,
    # weighted by ``demo_coef``, so GRPO sharpens the policy without drifting from the
    # wording of real calls (0 or no demonstrations set: off). One per group: a step of
    # fewer than ``groups_per_step`` groups replays its share. GRPO only: the preference
    # objectives have their own supervised term (``preference.sft_coef``)
    demo_coef: float = 0.1
    demo_examples: int = 2

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"learner.grpo.objective must be one of {OBJECTIVES}, got {self.objective!r}"
            )
        if self.preference.failure_agent and self.objective != "coevolving_dpo":
            raise ValueError(
                "learner.grpo.preference.failure_agent trains on failure pairs: it needs "
                f"objective coevolving_dpo, not {self.objective!r}"
            )
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError("ppo_epochs and mini_batches must be at least 1")
        if self.behaviour_weight_cap is not None and self.behaviour_weight_cap <= 0:
            raise ValueError("behaviour_weight_cap must be > 0 (or null for no cap)")
        if self.navigated_weight_cap <= 0:
            raise ValueError("navigated_weight_cap must be > 0")
        if self.demo_coef < 0 or self.demo_examples < 0:
            raise ValueError("demo_coef and demo_examples must be >= 0")

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * self.mini_batches


class WarmStartConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # defaults sized to end within minutes on 2 CPU cores: per-turn BFCL tasks with the
    # compact tool list are ~1.1k tokens (median), whole entries several times that
    enabled: bool = True
    tasks: int = 12
    # which seed tasks to learn the tool-call format on: single turns, whole entries, any
    grain: Literal["turn", "entry", "any"] = "turn"
    epochs: int = 2
    # more epochs where the tasks are few: the labelled default makes 6 steps (12 tasks,
    # batch 4, 2 epochs); the 4 first tasks of a no-label run made 2 and its v1 no call
    min_steps: int = 6
    lr: float = 5e-4
    batch_size: int = 4
    max_len: int = 4096
    # leave out tasks with an assistant message longer than this many tokens: keep it at
    # rollout.max_new_tokens, so the warm start teaches nothing the policy cannot generate
    max_target_tokens: int | None = 128
    # torch threads for the SFT; None: every core (rollout waits for the warm-started
    # policy, so the learner has the machine to itself until then)
    threads: int | None = None
    # adopt a warm-started policy another run exported (its policies/v1.safetensors)
    # instead of running the SFT, so runs on other machines start from the same policy;
    # with from_policy_sha256 set, a file with another digest is refused
    from_policy: str | None = None
    from_policy_sha256: str | None = None


class LearnerServiceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    device: str | None = None
    finetune: Literal["lora", "full"] = "lora"
    grpo: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    # train on fewer than groups_per_step groups once the first has waited this long
    max_wait_s: float = 30.0
    warm_start: WarmStartConfig = msgspec.field(default_factory=WarmStartConfig)
    # learner processes in data parallel (gloo on CPU, nccl on CUDA): each takes a share of
    # a step's groups; this service is rank 0 and starts the others (``ranks``)
    world_size: int = 1
    # seed tasks whose replayed ground truth GRPO's demonstration replay draws from
    # (``grpo.demo_coef``; only with the warm start, which needs the same kind of tasks);
    # chosen once per run and kept in the run directory
    demo_tasks: int = 64
    # give each large allocation its own mapping, freed at once (``memory.map_large_blocks``):
    # a step's peak about 2 GB lower in float32, its time 5-42% longer; off by default
    map_large_blocks: bool = False
    # the bus keeps each agent's newest this many versions (each a full copy of the
    # weights; rollout and the evaluator fetch only the newest), 0 all of them.
    # RUN_DIR/policies keeps every version whatever this says
    bus_versions: int = 8

    def __post_init__(self) -> None:
        if self.bus_versions < 0:
            raise ValueError("learner.bus_versions must be >= 0 (0 keeps every version)")
        if self.world_size < 1:
            raise ValueError("learner.world_size must be at least 1")
        if self.world_size > 1 and self.grpo.preference.failure_agent:
            raise ValueError(
                "learner.grpo.preference.failure_agent runs in one learner process: "
                "set learner.world_size to 1"
            )
