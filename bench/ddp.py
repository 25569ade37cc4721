"""Data-parallel learner benchmark: 2 ranks (gloo, one thread each) against 1 rank.

Real parts: the default policy (LoRA, float32 so the two sums can be compared to rounding),
per-turn BFCL train tasks of the default world (``--quick``: short one-call MathAPI tasks)
sampled by the transformers engine, and
``GrpoLearner.step`` with demonstration replay. Rewards are assigned by completion length
(longer than the group's median: 1, else 0), so every group trains: the comparison is of
the learners on one batch, not of the policy. Both runs start from the same adapter and
take ``STEPS`` steps on the same groups; each rank is its own process, started by
``torch.multiprocessing``. Reports the largest difference of any trained weight after the
last step (``max_param_diff``, target 1e-5) and the mean wall time of a step per world
size (``step_s``; the first step, which pays one-time costs, is left out).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from coevolve.bench import tables
from coevolve.harness import base_run_dir
from coevolve.shared.messages import RolloutGroup

STEPS = 3
TARGET_MAX_PARAM_DIFF = 1e-5


@dataclass(frozen=True)
class Setup:
    tasks: int
    group_size: int
    max_new_tokens: int
    demo_tasks: int
    steps: int = STEPS
    lr: float = 3e-4
    short_tasks: bool = False


QUICK = Setup(tasks=2, group_size=4, max_new_tokens=24, demo_tasks=4, short_tasks=True)
FULL = Setup(tasks=4, group_size=8, max_new_tokens=64, demo_tasks=8)


def run(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    cache = base_run_dir()
    with tempfile.TemporaryDirectory(prefix="coevolve-ddp-") as scratch:
        work = Path(scratch)
        sample_batch(setup, cache, work)
        runs = {size: run_ranks(size, setup, cache, work) for size in (1, 2)}
        single = torch.load(work / "final-1.pt", weights_only=True)
        double = torch.load(work / "final-2.pt", weights_only=True)
    diff = max(float((single[name] - double[name]).abs().max()) for name in single)
    result: dict[str, Any] = {
        "benchmark": "ddp",
        "quick": quick,
        "setup": asdict(setup),
        "backend": "gloo",
        "threads_per_rank": 1,
        "dtype": "float32",
        "cpu_count": os.cpu_count(),
        "max_param_diff": diff,
        "target_max_param_diff": TARGET_MAX_PARAM_DIFF,
        "within_target": diff <= TARGET_MAX_PARAM_DIFF,
        # the first step pays one-time costs: left out of the mean
        "step_s": {str(n): round(statistics.fmean(r["step_s"][1:]), 3) for n, r in runs.items()},
        "step_s_each": {str(size): r["step_s"] for size, r in runs.items()},
        "trained_tokens": runs[1]["trained_tokens"],
        "losses": {str(size): r["losses"] for size, r in runs.items()},
    }
    print_table(result)
    return result


def sample_batch(setup: Setup, cache: Path, work: Path) -> None:
    """The groups both runs train on, and the demonstrations they replay, to files."""
    from coevolve.schedules.lockstep import collect_groups
    from coevolve.services.learner.config import WarmStartConfig
    from coevolve.services.learner.warm_start import demonstrations
    from coevolve.shared.envs.bfcl.tasks import FOCUS_CLASSES, seed_pool
    from coevolve.shared.policy import SamplingParams, TransformersEngine, load_policy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = load_policy(run_dir=cache, device="cpu", dtype="float32")
    if setup.short_tasks:  # one-call MathAPI tasks: prompts of a few hundred tokens
        from coevolve.bench.short_tasks import train_and_heldout

        turns, _ = train_and_heldout(setup.tasks + setup.demo_tasks, 0)
    else:
        turns = [t for t in seed_pool({"turns": 1.0}, FOCUS_CLASSES) if any(t.ground_truth)]
    tasks = turns[: setup.tasks]
    params = SamplingParams(max_new_tokens=setup.max_new_tokens, temperature=1.0, seed=0)
    groups = collect_groups(TransformersEngine(policy), tasks, setup.group_size, params, 1)
    groups = [rewarded_by_length(group) for group in groups]
    (work / "groups.json").write_bytes(msgspec.json.encode(groups))
    demos = demonstrations(policy, turns[-setup.demo_tasks :], WarmStartConfig())
    (work / "demos.json").write_bytes(msgspec.json.encode([asdict(d) for d in demos]))


def rewarded_by_length(group: RolloutGroup) -> RolloutGroup:
    lengths = [sum(t.loss_mask) for t in group.trajectories]
    median = statistics.median(lengths)
    trajectories = [
        msgspec.structs.replace(t, reward=1.0 if n > median else 0.0)
        for t, n in zip(group.trajectories, lengths, strict=True)
    ]
    if len({t.reward for t in trajectories}) == 1:  # equal lengths: split by position
        trajectories = [
            msgspec.structs.replace(t, reward=float(i % 2)) for i, t in enumerate(trajectories)
        ]
    return msgspec.structs.replace(group, trajectories=trajectories)


def run_ranks(world_size: int, setup: Setup, cache: Path, work: Path) -> dict[str, Any]:
    """``setup.steps`` steps with ``world_size`` rank processes; rank 0's record."""
    import torch.multiprocessing as mp

    from coevolve.services.learner.ranks import free_address

    print(f"{world_size} rank(s): {setup.steps} steps", flush=True)
    mp.start_processes(
        rank_main,
        args=(world_size, free_address(), setup, str(cache), str(work)),
        nprocs=world_size,
        start_method="spawn",
    )
    record: dict[str, Any] = json.loads((work / f"record-{world_size}.json").read_text())
    return record


def rank_main(
    rank: int, world_size: int, address: str, setup: Setup, cache: str, work_dir: str
) -> None:
    """One rank: same policy and adapter as every other, the groups from file, the steps."""
    from coevolve.services.learner.config import LearnerConfig
    from coevolve.services.learner.distributed import broadcast_parameters, close_ranks, init_ranks
    from coevolve.services.learner.trainer import GrpoLearner
    from coevolve.shared.demonstrations import SftExample
    from coevolve.shared.policy import load_policy
    from coevolve.shared.policy.weights import trainable_state

    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = Path(work_dir)
    if world_size > 1:
        init_ranks(rank, world_size, address)
    try:
        policy = load_policy(run_dir=Path(cache), device="cpu", dtype="float32")
        broadcast_parameters(policy.model)
        learner = GrpoLearner(policy, LearnerConfig(lr=setup.lr, demo_examples=4))
        demos = msgspec.json.decode((work / "demos.json").read_bytes(), type=list[SftExample])
        learner.set_demonstrations(demos)
        groups = msgspec.json.decode((work / "groups.json").read_bytes(), type=list[RolloutGroup])
        step_s: list[float] = []
        losses: list[float] = []
        trained_tokens = 0
        for _ in range(setup.steps):
            started = time.perf_counter()
            metrics = learner.step(groups)
            step_s.append(round(time.perf_counter() - started, 3))
            losses.append(metrics.loss)
            trained_tokens += metrics.trained_tokens
        if rank == 0:
            state = {k: v.detach().clone() for k, v in trainable_state(policy.model).items()}
            torch.save(state, work / f"final-{world_size}.pt")
            record = {"step_s": step_s, "losses": losses, "trained_tokens": trained_tokens}
            (work / f"record-{world_size}.json").write_text(json.dumps(record))
    finally:
        close_ranks()


def print_table(result: dict[str, Any]) -> None:
    verdict = "within" if result["within_target"] else "OVER"
    tables.print_table(
        None,
        ("ranks", "step s", "losses"),
        [
            (
                size,
                f"{result['step_s'][size]:.3f}",
                ", ".join(f"{x:.6f}" for x in result["losses"][size]),
            )
            for size in ("1", "2")
        ],
        note=f"max |w(2 ranks) - w(1 rank)| after {result['setup']['steps']} steps: "
        f"{result['max_param_diff']:.2e} ({verdict} the {TARGET_MAX_PARAM_DIFF:g} target)",
    )
