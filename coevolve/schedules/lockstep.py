"""Lockstep schedule in one process: rollout, then learn, then (every F steps) synthesize.

This is the paper's schedule and the baseline the asynchronous services must beat: the
policy object is shared by the engine and the learner, so a learner step is visible to
the next rollout at once (no weight transfer); nothing runs concurrently.

- ``collect_groups``: one group of K episodes per task, all batched, as ``RolloutGroup``s;
- ``success_rate``: greedy single-episode success on a task list (held-out evaluation);
- ``LockstepLoop``: sample tasks -> ``collect_groups`` -> ``GrpoLearner.step`` (with the
  tasks' expert sides under a preference objective, ``learner.grpo.objective``) -> every
  ``synthesize_every`` steps call the synthesis hook (the data loop), which returns new
  tasks for the task source. Synthesis is optional (``None``): on CPU the data loop's LLM
  roles cost minutes per call;
- ``run_lockstep``: the loop on a pool file with the services' configuration: the
  ``rollout`` section's sampling, ``pool_store``'s group size and mix, ``learner``'s
  model, GRPO settings (``groups_per_step`` tasks a step) and SFT warm start, and the data
  loop's sections through :class:`~coevolve.schedules.synthesis.LockstepSynthesis`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from coevolve.services.learner.config import LearnerConfig, LearnerServiceConfig, WarmStartConfig
from coevolve.services.learner.preference_pairs import ExpertCache
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.services.learner.warm_start import (
    DEMONSTRATIONS_SEED,
    OVERSAMPLE,
    demonstration_origin,
    demonstrations,
    run_warm_start,
    warm_start_tasks,
)
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.rollout.config import RolloutConfig
from coevolve.shared.config import Settings
from coevolve.shared.envs import make_environment
from coevolve.shared.episodes import run_groups
from coevolve.shared.messages import Origin, RolloutGroup, Task, Trajectory
from coevolve.shared.policy import (
    Engine,
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    load_policy,
)

# groups since the last synthesis -> new tasks for the source (the data loop)
Synthesizer = Callable[[list[RolloutGroup]], list[Task]]

# the learner right after its warm start, kept so a restarted lockstep run does not train
# it again (the service keeps it in its own checkpoint)
WARM_START_CHECKPOINT = Path("lockstep") / "warm_start.pt"
# a refill round samples with its own seed, not the step's first draw again
REFILL_SEED_STRIDE = 7919
# the fields of LockstepConfig that the ``rollout`` section sets
ROLLOUT_FIELDS = ("max_new_tokens", "max_steps", "temperature", "top_p", "partial_credit")


def collect_groups(
    engine: Engine,
    tasks: Sequence[Task],
    group_size: int,
    params: SamplingParams,
    max_steps: int,
    partial_credit: float = 0.0,
) -> list[RolloutGroup]:
    """One group of ``group_size`` episodes per task, every episode in one batch."""
    groups = run_groups(
        engine,
        lambda: make_environment("bfcl"),
        list(tasks),
        group_size,
        params,
        max_steps,
        partial_credit=partial_credit,
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
    engine: TransformersEngine,
    tasks: Sequence[Task],
    max_new_tokens: int,
    max_steps: int,
    stop: tuple[str, ...] = (),
) -> tuple[float, list[Trajectory]]:
    """Mean reward of one greedy episode per task, and the episodes."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    groups = run_groups(engine, lambda: make_environment("bfcl"), list(tasks), 1, params, max_steps)
    episodes = [group[0] for group in groups]
    return sum(t.reward for t in episodes) / max(1, len(episodes)), episodes


def informative_groups(
    source: Callable[[int], list[Task]],
    sample: Callable[[list[Task], int], list[RolloutGroup]],
    wanted: int,
    refill_rounds: int,
) -> tuple[list[RolloutGroup], list[RolloutGroup]]:
    """A step's groups, and every group sampled for it.

    ``sample(tasks, round)`` rolls out one group per task. Up to ``refill_rounds`` times,
    groups whose rewards all tie are replaced by groups of fresh tasks from ``source``;
    where too few informative groups came, the step gets all it sampled (the learner
    skips the ties)."""
    sampled: list[RolloutGroup] = []
    informative: list[RolloutGroup] = []
    for refill in range(1 + refill_rounds):
        fresh = sample(source(wanted - len(informative)), refill)
        sampled.extend(fresh)
        informative.extend(g for g in fresh if len(set(g.rewards())) > 1)
        if len(informative) >= wanted:
            return informative, sampled
    return sampled, sampled


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
    top_p: float = 1.0
    partial_credit: float = 0.0  # see RolloutConfig.partial_credit
    stop: tuple[str, ...] = ()  # see RolloutConfig.stop
    synthesize_every: int = 0  # 0: never
    seed: int = 0
    # rounds of fresh tasks drawn to replace groups whose rewards are all equal (no
    # advantage, nothing to learn): DAPO's dynamic sampling; 0: train on what came
    refill_rounds: int = 0

    def __post_init__(self) -> None:
        if self.refill_rounds < 0:
            raise ValueError(f"refill_rounds must be 0 or more, got {self.refill_rounds}")

    @classmethod
    def from_settings(
        cls, settings: Settings, *, synthesize_every: int = 0, seed: int = 0
    ) -> LockstepConfig:
        """What the services would do: ``rollout``'s sampling and episode length,
        ``pool_store``'s group size, ``learner.grpo.groups_per_step`` tasks a step."""
        rollout = settings.section("rollout", RolloutConfig)
        learner = settings.section("learner", LearnerServiceConfig)
        # the same names in both: how the policy samples and how long an episode runs
        sampling: dict[str, Any] = {name: getattr(rollout, name) for name in ROLLOUT_FIELDS}
        return cls(
            stop=tuple(rollout.stop),
            tasks_per_step=learner.grpo.groups_per_step,
            group_size=settings.section("pool_store", PoolStoreConfig).group_size,
            synthesize_every=synthesize_every,
            seed=seed,
            **sampling,
        )


@dataclass
class IterationReport:
    step: int
    rollout_s: float
    learn_s: float
    synthesize_s: float
    reward_mean: float
    new_tasks: int
    metrics: StepMetrics
    groups_sampled: int = 0

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
    # how a preference objective's expert sides are built (the warm start's length limits)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def __post_init__(self) -> None:
        learner_config = self.learner_config or LearnerConfig()
        self.engine = TransformersEngine(self.policy)
        self.learner = GrpoLearner(self.policy, learner_config, log_dir=self.log_dir)
        self.experts: ExpertCache | None = None
        if learner_config.objective != "grpo":
            self.experts = ExpertCache(self.policy, self.warm_start)
        self.iterations = 0
        # groups since the last synthesis: the signal detectors see every group once
        self.unsynthesized: list[RolloutGroup] = []

    def iteration(self) -> IterationReport:
        """Rollout, then one learner step, then synthesis when it is due."""
        config = self.config
        params = SamplingParams(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=config.seed * 1_000_003 + self.iterations,
            stop=config.stop,
        )
        started = time.perf_counter()
        # the learner's version (after a warm start, 1): the groups are on-policy
        self.engine.policy_version = self.learner.version

        drawn: dict[str, Task] = {}

        def sample(tasks: list[Task], refill: int) -> list[RolloutGroup]:
            drawn.update((task.id, task) for task in tasks)
            seed = None if params.seed is None else params.seed + refill * REFILL_SEED_STRIDE
            return collect_groups(
                self.engine,
                tasks,
                config.group_size,
                replace(params, seed=seed),
                config.max_steps,
                config.partial_credit,
            )

        groups, sampled = informative_groups(
            self.source, sample, config.tasks_per_step, config.refill_rounds
        )
        rolled = time.perf_counter()
        experts = None
        if self.experts is not None:
            experts = self.experts.for_tasks([drawn[g.task_id] for g in groups])
        metrics = self.learner.step(groups, experts)
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
        rewards = [r for g in sampled for r in g.rewards()]
        return IterationReport(
            step=self.iterations,
            rollout_s=rolled - started,
            learn_s=learned - rolled,
            synthesize_s=done - learned,
            reward_mean=sum(rewards) / max(1, len(rewards)),
            new_tasks=len(new_tasks),
            metrics=metrics,
            groups_sampled=len(sampled),
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


def warm_start_once(
    learner: GrpoLearner,
    store: PoolStore,
    run_dir: Path,
    config: WarmStartConfig,
    echo: Callable[[str], None] = print,
    origin: Origin = "seed",
) -> bool:
    """The learner service's SFT warm start on the pool's tasks of ``origin`` (the
    labelled seed tasks; D0's, origin "explored", with no labels), once per run
    directory: the warm-started policy becomes the KL reference and version 1, and the
    learner is saved; later calls restore it. Returns whether the learner is warm-started."""
    path = run_dir / WARM_START_CHECKPOINT
    if path.is_file():
        learner.restore_checkpoint(path)
        echo(f"warm start: restored {path}")
        return learner.warm_started
    if not config.enabled:
        return False
    sampled = store.sample_batch(OVERSAMPLE * config.tasks, mix={origin: 1.0}, seed=0)
    tasks = warm_start_tasks(sampled, config)
    if not tasks:
        echo(f"warm start: no {config.grain} task with ground truth in the pool; skipped")
        return False
    echo(f"warm start: SFT on {len(tasks)} tasks for {config.epochs} epoch(s)")
    report = run_warm_start(learner.policy, tasks, config, progress=True)
    learner.freeze_reference()
    learner.version = max(learner.version, 1)
    learner.save_checkpoint(path)
    echo(f"warm start: loss {report.first_loss:.3f} -> {report.final_loss:.3f}, {path}")
    return True


def run_lockstep(
    settings: Settings,
    store: PoolStore,
    *,
    iterations: int,
    synthesizer: Synthesizer | None = None,
    synthesize_every: int = 1,
    seed: int = 0,
    report: Callable[[IterationReport], None] | None = None,
    on_new_tasks: Callable[[list[Task]], None] | None = None,
    echo: Callable[[str], None] = print,
) -> list[IterationReport]:
    """``iterations`` lockstep iterations on tasks sampled from ``store`` (by the
    ``pool_store`` section's mix), configured by the services' sections of ``settings``.

    The policy is the ``learner`` section's (loaded and cached under the run directory);
    TensorBoard scalars go to ``RUN_DIR/tensorboard/lockstep``. One torch thread unless
    OMP_NUM_THREADS says otherwise. Before the first step the policy gets the learner's
    warm start, once per run directory. ``synthesizer`` (the data loop) runs every
    ``synthesize_every`` steps; the tasks it returns are passed to ``on_new_tasks``.
    """
    if synthesize_every < 0:
        raise ValueError(f"synthesize_every must be >= 0, got {synthesize_every}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run_dir = settings.run_dir
    learner = settings.section("learner", LearnerServiceConfig)
    mix = settings.section("pool_store", PoolStoreConfig).mix
    draws = 0

    def sample(count: int) -> list[Task]:
        nonlocal draws
        draws += 1
        batch_seed = seed * 1_000_003 + draws
        # jobs=True: the draws are the schedule's jobs, counted against each task's cap
        tasks = store.sample_batch(count, mix=mix, environment="bfcl", seed=batch_seed, jobs=True)
        if not tasks:
            origins = sorted(mix) if mix else "all"
            raise ValueError(f"the pool has no active bfcl task (origins {origins})")
        return tasks

    policy = load_policy(
        learner.model, run_dir=run_dir, device=learner.device, finetune=learner.finetune
    )
    loop = LockstepLoop(
        policy,
        sample,
        LockstepConfig.from_settings(settings, synthesize_every=synthesize_every, seed=seed),
        learner.grpo,
        log_dir=run_dir / "tensorboard" / "lockstep",
        synthesize=synthesizer,
        on_new_tasks=on_new_tasks,
        warm_start=learner.warm_start,
    )
    try:
        origin = demonstration_origin(settings.labels)
        warm = warm_start_once(loop.learner, store, run_dir, learner.warm_start, echo, origin)
        replay = learner.grpo.demo_coef > 0 and learner.grpo.objective == "grpo"
        if warm and replay and learner.demo_tasks > 0:
            count = learner.demo_tasks
            sampled = store.sample_batch(
                OVERSAMPLE * count, mix={origin: 1.0}, seed=DEMONSTRATIONS_SEED
            )
            tasks = warm_start_tasks(sampled, learner.warm_start, count)
            examples = demonstrations(loop.learner.policy, tasks, learner.warm_start)
            loop.learner.set_demonstrations(examples)
            echo(f"demonstration replay: {len(examples)} examples of {len(tasks)} tasks")
        return loop.run(iterations, report)
    finally:
        loop.close()
