"""Preference pairs from rollout groups, for the learner's preference objectives.

A pair is two token sequences of the same task, ``chosen`` preferred to ``rejected``, each
with the mask of the agent's own tokens (its assistant messages): the prompt, the user
turns and the tools' answers are context and carry no loss.

- **expert vs failure** (ETO): the chosen side is the task's ground truth as an ideal agent
  would have lived it, built exactly as the SFT warm start and the demonstration replay
  build theirs (``warm_start.demonstrations``: the calls replayed in the real environment,
  one call per assistant message with its real result after it, then the closing reply,
  tokenized with the policy's chat template and tools prompt); the rejected side is a
  trajectory of the group whose reward is below a solve's (``SOLVED``; the rollout gives
  an unsolved episode 0.4 x its share of matched ground-truth calls).
- **failure vs failure**: two failures of a task with different partial credit, the
  higher reward chosen. The co-evolving method trains its failure agent on these
  (``failure_agent_pairs``, ``preference.failure_agent``); without that agent
  ``coevolving_dpo`` gives them to the target (``failure_pairs``).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from coevolve.services.learner.config import Objective, WarmStartConfig
from coevolve.services.learner.sft import supervised_mask
from coevolve.services.learner.warm_start import demonstrations
from coevolve.shared.messages import RolloutGroup, Task, Trajectory
from coevolve.shared.policy import LoadedPolicy

log = logging.getLogger(__name__)

# the rollout's reward of a solved episode; anything lower is a failure
SOLVED = 1.0
EXPERT = "expert"
# expert sides kept by ``ExpertCache`` (each is one tokenized conversation)
EXPERT_CACHE_SIZE = 4096

PairKind = Literal["expert", "failure"]


@dataclass(frozen=True)
class PairSide:
    """One side of a pair: the whole sequence and the mask of the agent's own tokens."""

    token_ids: list[int]
    loss_mask: list[int]
    reward: float
    source: str  # EXPERT, or the trajectory's id

    @property
    def agent_tokens(self) -> int:
        return sum(self.loss_mask)

    def cut(self, limit: int | None) -> PairSide:
        """The side's first ``limit`` tokens (None: all)."""
        if limit is None or len(self.token_ids) <= limit:
            return self
        return PairSide(self.token_ids[:limit], self.loss_mask[:limit], self.reward, self.source)


@dataclass(frozen=True)
class PreferencePair:
    task_id: str
    chosen: PairSide
    rejected: PairSide
    kind: PairKind  # expert: the chosen side is the expert's (its NLL is trained too)

    def cut(self, limit: int | None) -> PreferencePair | None:
        """Both sides cut at ``limit``; None when a side has no agent token left."""
        chosen, rejected = self.chosen.cut(limit), self.rejected.cut(limit)
        if not chosen.agent_tokens or not rejected.agent_tokens:
            return None
        if chosen is self.chosen and rejected is self.rejected:
            return self
        return PreferencePair(self.task_id, chosen, rejected, self.kind)


def trajectory_side(trajectory: Trajectory) -> PairSide | None:
    """The trajectory as a pair side; None when it cannot be scored (lengths differ, no
    generated token, or the first token is marked as generated)."""
    mask = list(trajectory.loss_mask)
    if len(mask) != len(trajectory.token_ids) or not any(mask) or mask[0]:
        return None
    return PairSide(list(trajectory.token_ids), mask, float(trajectory.reward), trajectory.id)


def failures(group: RolloutGroup) -> list[PairSide]:
    """The group's scorable trajectories that did not solve the task, in group order."""
    sides = []
    for trajectory in group.trajectories:
        if trajectory.reward >= SOLVED:
            continue
        side = trajectory_side(trajectory)
        if side is None:
            log.warning("trajectory %s cannot be scored; not paired", trajectory.id)
            continue
        sides.append(side)
    return sides


def expert_pairs(group: RolloutGroup, expert: PairSide | None) -> list[PreferencePair]:
    """ETO's pairs: the expert against each failure of the group (none without an expert
    or without a failure)."""
    if expert is None:
        return []
    return [PreferencePair(group.task_id, expert, f, "expert") for f in failures(group)]


def failure_pairs(group: RolloutGroup, limit: int | None = None) -> list[PreferencePair]:
    """Failure-vs-failure pairs by partial credit: every two failures whose rewards differ,
    the higher one chosen; the widest reward gaps first (ties in group order), at most
    ``limit`` of them (None: all)."""
    return ranked_failure_pairs(group.task_id, failures(group), limit)


def failure_agent_pairs(
    groups: Iterable[RolloutGroup], limit: int | None = None
) -> list[PreferencePair]:
    """The failure agent's pairs: per task, the failures of every group of it (the target's
    and the failure agent's alike) paired by partial credit as ``failure_pairs`` does, at
    most ``limit`` per group of the task."""
    by_task: OrderedDict[str, list[RolloutGroup]] = OrderedDict()
    for group in groups:
        by_task.setdefault(group.task_id, []).append(group)
    pairs: list[PreferencePair] = []
    for task_id, task_groups in by_task.items():
        sides = [side for group in task_groups for side in failures(group)]
        most = None if limit is None else limit * len(task_groups)
        pairs.extend(ranked_failure_pairs(task_id, sides, most))
    return pairs


def ranked_failure_pairs(
    task_id: str, sides: Sequence[PairSide], limit: int | None
) -> list[PreferencePair]:
    """Every two of ``sides`` whose rewards differ, the higher chosen, the widest gaps
    first (ties in order), at most ``limit``."""
    pairs = [
        (a, b) if a.reward > b.reward else (b, a)
        for i, a in enumerate(sides)
        for b in sides[i + 1 :]
        if a.reward != b.reward
    ]
    pairs.sort(key=lambda pair: pair[0].reward - pair[1].reward, reverse=True)
    kept = pairs if limit is None else pairs[:limit]
    return [PreferencePair(task_id, chosen, rejected, "failure") for chosen, rejected in kept]


def preference_pairs(
    groups: Iterable[RolloutGroup],
    experts: Mapping[str, PairSide],
    objective: Objective,
    failure_pairs_per_group: int | None = None,
    failure_agent: bool = False,
) -> list[PreferencePair]:
    """The pairs the target trains on under ``objective``: per group, ``eto``'s
    expert-vs-failure pairs (groups whose task has an expert in ``experts``) and, for
    ``coevolving_dpo``, the failure-vs-failure pairs too. With the ``failure_agent``
    those go to the failure agent instead (``failure_agent_pairs``), and the target's are
    the expert against the failures of both agents: the failure agent's are its hard
    negatives."""
    if objective == "grpo":
        raise ValueError("grpo trains on groups, not on preference pairs")
    pairs: list[PreferencePair] = []
    for group in groups:
        pairs.extend(expert_pairs(group, experts.get(group.task_id)))
        if objective == "coevolving_dpo" and not failure_agent:
            pairs.extend(failure_pairs(group, failure_pairs_per_group))
    return pairs


def expert_sides(
    policy: LoadedPolicy, tasks: Sequence[Task], config: WarmStartConfig
) -> dict[str, PairSide]:
    """The expert side of each task with ground truth that replays cleanly, as the warm
    start builds its examples (``warm_start.demonstrations``, with ``config``'s length
    limits). A conversation that does not fit one sequence (its tool list changed
    mid-episode) is left out: a pair compares two single sequences."""
    examples = demonstrations(policy, tasks, config)
    sequences = Counter(example.task_id for example in examples)
    sides: dict[str, PairSide] = {}
    for example in examples:
        if sequences[example.task_id] > 1:
            continue
        mask = supervised_mask(example)
        sides[example.task_id] = PairSide(list(example.input_ids), mask, SOLVED, EXPERT)
    for task_id, count in sequences.items():
        if count > 1:
            log.info("no expert for %s: its conversation takes %d sequences", task_id, count)
    return sides


class ExpertCache:
    """Expert sides by task id, each built once (a replay in the environment); a task
    without one (no ground truth, a failed replay, too long) is remembered as such."""

    def __init__(
        self, policy: LoadedPolicy, config: WarmStartConfig, size: int = EXPERT_CACHE_SIZE
    ) -> None:
        self.policy = policy
        self.config = config
        self.size = size
        self.sides: OrderedDict[str, PairSide | None] = OrderedDict()

    def missing(self, task_ids: Iterable[str]) -> list[str]:
        """The ids among ``task_ids`` not built yet, each once."""
        return [t for t in dict.fromkeys(task_ids) if t not in self.sides]

    def build(self, tasks: Sequence[Task]) -> None:
        """Build and keep the expert sides of ``tasks`` (slow: replays them)."""
        built = expert_sides(self.policy, tasks, self.config)
        for task in tasks:
            self.sides[task.id] = built.get(task.id)
            self.sides.move_to_end(task.id)
        while len(self.sides) > self.size:
            self.sides.popitem(last=False)

    def experts(self, task_ids: Iterable[str]) -> dict[str, PairSide]:
        """The known expert sides of ``task_ids``."""
        found = {t: self.sides.get(t) for t in task_ids}
        return {t: side for t, side in found.items() if side is not None}

    def for_tasks(self, tasks: Sequence[Task]) -> dict[str, PairSide]:
        """The expert sides of ``tasks``, building the missing ones."""
        wanted = set(self.missing(t.id for t in tasks))
        missing = [t for t in {t.id: t for t in tasks}.values() if t.id in wanted]
        if missing:
            self.build(missing)
        return self.experts(t.id for t in tasks)
