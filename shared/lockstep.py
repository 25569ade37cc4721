"""Lockstep schedule in one process: rollout, then learn, then (every F steps) synthesize.

This is the paper's schedule and the baseline the asynchronous services must beat: the
policy object is shared by the engine and the learner, so a learner step is visible to
the next rollout at once (no weight transfer); nothing runs concurrently.

- ``collect_groups``: one group of K episodes per task, all batched, as ``RolloutGroup``s;
- ``success_rate``: greedy single-episode success on a task list (held-out evaluation);
- ``LockstepLoop``: sample tasks -> ``collect_groups`` -> ``GrpoLearner.step`` -> every
  ``synthesize_every`` steps call the synthesis hook (the data loop), which returns new
  tasks for the task source. Synthesis is optional (``None``): on CPU the data loop's LLM
  roles cost minutes per call.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coevolve.services.learner.trainer import GrpoLearner, LearnerConfig, StepMetrics
from coevolve.shared.envs import make_environment
from coevolve.shared.episodes import run_groups
from coevolve.shared.messages import RolloutGroup, Task, Trajectory
from coevolve.shared.policy import LoadedPolicy, SamplingParams, TransformersEngine

# groups since the last synthesis -> new tasks for the source (the data loop)
Synthesizer = Callable[[list[RolloutGroup]], list[Task]]


def collect_groups(
    engine: TransformersEngine,
    tasks: Sequence[Task],
    group_size: int,
    params: SamplingParams,
    max_steps: int,
) -> list[RolloutGroup]:
    """One group of ``group_size`` episodes per task, every episode in one batch."""
    groups = run_groups(
        engine, lambda: make_environment("bfcl"), list(tasks), group_size, params, max_steps
    )
    return [
        RolloutGroup(
            task_id=task.id,
            origin=task.origin,
            policy_version=engine.policy_version,
            trajectories=trajectories,
        )
        for task, trajectories in zip(tasks, groups, strict=True)
    ]


def success_rate(
    engine: TransformersEngine, tasks: Sequence[Task], max_new_tokens: int, max_steps: int
) -> tuple[float, list[Trajectory]]:
    """Mean reward of one greedy episode per task, and the episodes."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    groups = run_groups(engine, lambda: make_environment("bfcl"), list(tasks), 1, params, max_steps)
    episodes = [group[0] for group in groups]
    return sum(t.reward for t in episodes) / max(1, len(episodes)), episodes


class TaskCycle:
    """Tasks in shuffled rounds: every task once before any twice; new tasks join."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("no tasks to sample from")
        self.tasks = list(tasks)
        self.rng = random.Random(seed)
        self.queue: list[Task] = []

    def add(self, tasks: Sequence[Task]) -> None:
        self.tasks.extend(tasks)

    def __call__(self, count: int) -> list[Task]:
        chosen: list[Task] = []
        while len(chosen) < count:
            if not self.queue:
                self.queue = list(self.tasks)
                self.rng.shuffle(self.queue)
            chosen.append(self.queue.pop())
        return chosen


@dataclass(frozen=True)
class LockstepConfig:
    tasks_per_step: int = 2
    group_size: int = 4
    max_new_tokens: int = 48
    max_steps: int = 2  # assistant messages per episode: the calls, then the closing reply
    temperature: float = 1.0
    synthesize_every: int = 0  # 0: never
    seed: int = 0


@dataclass
class IterationReport:
    step: int
    rollout_s: float
    learn_s: float
    synthesize_s: float
    reward_mean: float
    new_tasks: int
    metrics: StepMetrics

    @property
    def wall_s(self) -> float:
        return self.rollout_s + self.learn_s + self.synthesize_s


@dataclass
class LockstepLoop:
    policy: LoadedPolicy
    source: Callable[[int], list[Task]]
    config: LockstepConfig = field(default_factory=LockstepConfig)
    learner_config: LearnerConfig | None = None
    log_dir: Path | None = None
    synthesize: Synthesizer | None = None
    on_new_tasks: Callable[[list[Task]], None] | None = None

    def __post_init__(self) -> None:
        learner_config = self.learner_config or LearnerConfig()
        self.engine = TransformersEngine(self.policy)
        self.learner = GrpoLearner(self.policy, learner_config, log_dir=self.log_dir)
        self.iterations = 0
        # groups since the last synthesis: the signal detectors see every group once
        self.unsynthesized: list[RolloutGroup] = []

    def iteration(self) -> IterationReport:
        """Rollout, then one learner step, then synthesis when it is due."""
        config = self.config
        params = SamplingParams(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            seed=config.seed * 1_000_003 + self.iterations,
        )
        started = time.perf_counter()
        tasks = self.source(config.tasks_per_step)
        groups = collect_groups(self.engine, tasks, config.group_size, params, config.max_steps)
        rolled = time.perf_counter()
        metrics = self.learner.step(groups)
        # same weights object: the engine serves the new version from the next rollout on
        self.engine.policy_version = self.learner.version
        learned = time.perf_counter()
        self.iterations += 1
        new_tasks: list[Task] = []
        if self.synthesize is not None and config.synthesize_every > 0:
            self.unsynthesized.extend(groups)
        due = config.synthesize_every > 0 and self.iterations % config.synthesize_every == 0
        if due and self.synthesize is not None:
            pending, self.unsynthesized = self.unsynthesized, []
            new_tasks = self.synthesize(pending)
            if new_tasks and self.on_new_tasks is not None:
                self.on_new_tasks(new_tasks)
        done = time.perf_counter()
        rewards = [r for g in groups for r in g.rewards()]
        return IterationReport(
            step=self.iterations,
            rollout_s=rolled - started,
            learn_s=learned - rolled,
            synthesize_s=done - learned,
            reward_mean=sum(rewards) / max(1, len(rewards)),
            new_tasks=len(new_tasks),
            metrics=metrics,
        )

    def run(
        self, iterations: int, report: Callable[[IterationReport], None] | None = None
    ) -> list[IterationReport]:
        reports = []
        for _ in range(iterations):
            result = self.iteration()
            reports.append(result)
            if report is not None:
                report(result)
        return reports

    def close(self) -> None:
        self.learner.close()
