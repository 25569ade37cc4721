"""Hard negatives: do the co-evolving failure agent's failures come closer to success than
the target's own failures on the same tasks?

From the objectives experiment's committed warm start, on BFCL's per-turn train tasks, with
the services' default sampling, episode length and group size, each round samples a group
of ``tasks_per_round`` tasks with the target and one with the failure agent (the rollout's
llama.cpp engine, the agent's adapter swapped in) and sets each failure of the failure
agent (reward below 1) against the target's mean failure on the same task. The first
``train_rounds`` rounds (and any while it has had no update) end with the failure agent's
DPO step of ``coevolving_dpo``; the target stays the warm start (an ETO step on these
turns takes minutes). Pairs from before the failure agent's first update are the
control, the later ones the measurement, until ``min_pairs``. Writes ``result.json``
under ``RUN_DIR/bench/hard-negatives-*`` after every round (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from coevolve.bench import tables
from coevolve.bench.lockstep_runs import drive, open_loop
from coevolve.harness import output_dir
from coevolve.report.hard_negatives import SOLVED, compare_failures
from coevolve.report.stats import paired_p_value
from coevolve.schedules.lockstep import LockstepConfig
from coevolve.services.learner.config import LearnerConfig, LearnerServiceConfig
from coevolve.services.learner.preference import failure_agent_step
from coevolve.services.learner.warm_start import adopt_warm_start
from coevolve.services.rollout.config import RolloutConfig
from coevolve.shared.config import load_settings
from coevolve.shared.envs.bfcl.tasks import load_turn_tasks, split_tasks
from coevolve.shared.messages import RolloutGroup

# the warm start every arm of the objectives experiment started from
WARM_START = Path(__file__).resolve().parents[1] / "docs/results/objectives/warm-start.safetensors"


@dataclass(frozen=True)
class Setup:
    min_pairs: int = 200
    max_rounds: int = 40
    tasks_per_round: int = 4
    # rounds that end with the failure agent's step (more while it has had no update: a
    # step with no failure pairs leaves it as it was); the rest only sample
    train_rounds: int = 4
    failure_pairs_per_group: int = 1
    seed: int = 0
    group_size: int | None = None  # None: pool_store.group_size
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens


FULL = Setup()
QUICK = Setup(
    min_pairs=1, max_rounds=3, tasks_per_round=1, train_rounds=1, group_size=2, max_new_tokens=32
)


@dataclass(frozen=True)
class Pair:
    task_id: str
    round: int
    failure_agent: float  # reward of one failure of the failure agent
    target: float  # the target's mean failure on the task in the same round


def pairs_of(
    round_index: int, target: Sequence[RolloutGroup], failure: Sequence[RolloutGroup]
) -> list[Pair]:
    """Each failure of the failure agent against the target's mean failure on its task; a
    task the target solved every time has nothing to set against and is left out."""
    theirs = {g.task_id: fails for g in target if (fails := [r for r in g.rewards() if r < SOLVED])}
    return [
        Pair(g.task_id, round_index, reward, sum(theirs[g.task_id]) / len(theirs[g.task_id]))
        for g in failure
        if g.task_id in theirs
        for reward in g.rewards()
        if reward < SOLVED
    ]


def summary(pairs: Sequence[Pair]) -> dict[str, Any] | None:
    """The report's comparison of the pairs, with a paired permutation p-value."""
    found = compare_failures([(p.task_id, p.failure_agent, p.target) for p in pairs])
    if found is None:
        return None
    p_value, test = paired_p_value([p.failure_agent for p in pairs], [p.target for p in pairs])
    return {
        "pairs": found.pairs,
        "tasks": found.tasks,
        "failure_agent_mean": found.failure_agent_mean,
        "target_mean": found.target_mean,
        "gap": found.gap,
        "gap_low": found.low,
        "gap_high": found.high,
        "p_value": p_value,
        "test": test,
    }


def configured(setup: Setup) -> tuple[LearnerServiceConfig, LearnerConfig, LockstepConfig]:
    """The learner service's section, its GRPO settings with co-evolving DPO's failure
    agent, and the lockstep loop's sampling: the services' defaults, sized by ``setup``."""
    settings = load_settings()
    service = settings.section("learner", LearnerServiceConfig)
    preference = msgspec.structs.replace(
        service.grpo.preference,
        failure_agent=True,
        failure_pairs_per_group=setup.failure_pairs_per_group,
    )
    learner = msgspec.structs.replace(
        service.grpo, objective="coevolving_dpo", preference=preference
    )
    lockstep = LockstepConfig.from_settings(settings, seed=setup.seed)
    rollout = settings.section("rollout", RolloutConfig)
    config = replace(
        lockstep,
        group_size=setup.group_size or lockstep.group_size,
        max_new_tokens=setup.max_new_tokens or lockstep.max_new_tokens,
        # a per-turn task has one user turn: the rollout's budget for it
        max_steps=rollout.max_steps or rollout.max_steps_per_turn,
    )
    return service, learner, config


def run(quick: bool, setup: Setup | None = None, out: Path | None = None) -> dict[str, Any]:
    """Rounds until ``min_pairs`` measured pairs (or ``max_rounds``); the summary, also
    written to ``out/result.json`` (default ``RUN_DIR/bench/hard-negatives-<time>``)."""
    setup = setup or (QUICK if quick else FULL)
    if not WARM_START.is_file():
        raise FileNotFoundError(f"the committed warm start is missing: {WARM_START}")
    service, learner_config, config = configured(setup)
    out = out or output_dir("hard-negatives")
    out.mkdir(parents=True, exist_ok=True)
    train, _ = split_tasks(load_turn_tasks())
    loop = open_loop(
        train,
        config,
        learner_config,
        out,
        engine="llama_cpp",
        model=service.model,
        device=service.device,
    )
    digest = adopt_warm_start(loop.learner, WARM_START)
    # the target stays the warm start: its adapter is exported once
    target_weights = (loop.learner.export_weights(), loop.learner.version)
    control: list[Pair] = []
    measured: list[Pair] = []
    started = time.perf_counter()

    def record(rounds: list[dict[str, Any]]) -> dict[str, Any]:
        """The result so far, written after every round: a stopped run keeps its pairs."""
        result = {
            "setup": {
                **setup.__dict__,
                "group_size": config.group_size,
                "warm_start_sha256": digest,
            },
            "measured": summary(measured),
            "control": summary(control),
            "rounds": rounds,
            "pairs": [p.__dict__ for p in [*control, *measured]],
            "seconds": round(time.perf_counter() - started, 1),
            "reached_min_pairs": len(measured) >= setup.min_pairs,
        }
        (out / "result.json").write_text(json.dumps(result, indent=1))
        return result

    def play(index: int) -> dict[str, Any]:
        learner, agent = loop.learner, loop.learner.failure_agent
        assert agent is not None
        tasks = loop.source(setup.tasks_per_round)
        # the failure agent's own draws: with one seed, round 1's identical agents would
        # sample identical groups and the control would be 0 by construction
        seed = setup.seed * 1_000_003 + 2 * index
        target = loop.sample(tasks, seed, target_weights)
        failure = [
            msgspec.structs.replace(g, agent="failure")
            for g in loop.sample(tasks, seed + 1, (agent.export(learner), agent.version))
        ]
        trained = agent.step_count > 0
        found = pairs_of(index, target, failure)
        (measured if trained else control).extend(found)
        # no measurement before the failure agent's first update, however long it takes
        trains = index <= setup.train_rounds or not trained
        step = failure_agent_step(learner, agent, [*target, *failure]) if trains else None
        return {
            "round": index,
            "failure_agent_step": trains,
            "failure_agent_trained": trained,
            "pairs": len(found),
            "target_solved": _solved_share(target),
            "failure_agent_solved": _solved_share(failure),
            "target_version": learner.version,
            "failure_agent_version": agent.version,
            "failure_agent_pairs": step["failure_agent_pairs"] if step else None,
            "seconds": round(time.perf_counter() - started, 1),
        }

    def describe(r: dict[str, Any]) -> str:
        kind = "measured" if r["failure_agent_trained"] else "control"
        return (
            f"round {r['round']}: {r['pairs']} pairs ({kind}), {len(measured)} measured in "
            f"all; failure agent v{r['failure_agent_version']}; {r['seconds']:.0f} s"
        )

    try:
        rounds = drive(
            setup.max_rounds,
            play,
            describe,
            after=record,
            until=lambda _: len(measured) >= setup.min_pairs,
        )
    finally:
        loop.close()
    result = record(rounds)
    _print(result, out)
    return result


def _solved_share(groups: Sequence[RolloutGroup]) -> float:
    rewards = [r for g in groups for r in g.rewards()]
    return round(sum(r >= SOLVED for r in rewards) / len(rewards), 3) if rewards else 0.0


def _print(result: dict[str, Any], out: Path) -> None:
    def row(name: str, found: dict[str, Any] | None) -> list[object]:
        if found is None:
            return [name, 0, None, None, None, None, None]
        return [
            name,
            found["pairs"],
            found["tasks"],
            f"{found['failure_agent_mean']:.3f}",
            f"{found['target_mean']:.3f}",
            f"{found['gap']:+.3f} [{found['gap_low']:+.3f}, {found['gap_high']:+.3f}]",
            f"{found['p_value']:.3f}",
        ]

    tables.print_table(
        "Failure agent's failures against the target's on the same task (reward: "
        "rollout.partial_credit x the environment's partial credit)",
        ["failures", "n", "tasks", "failure agent", "target", "difference [95% bootstrap]", "p"],
        [
            row("before its first update (control)", result["control"]),
            row("after (measured)", result["measured"]),
        ],
        note=f"{len(result['rounds'])} rounds, {result['seconds']:.0f} s; {out / 'result.json'}",
    )
