"""The lockstep loop in one process, as the benchmarks that train drive it.

:func:`open_loop` seeds torch, loads the policy from the base run (its converted models
cached there) and builds a :class:`~coevolve.schedules.lockstep.LockstepLoop` on it,
sampling with the transformers engine or, as the rollout service does, llama.cpp; its
TensorBoard scalars go under the benchmark's directory. :func:`drive` runs numbered
rounds of it: each round returns its record, printed as one line, and ``after`` sees
the records after each round (a benchmark writes its result there, so a stopped run
keeps its rounds) until ``until`` says the benchmark has what it needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from coevolve.harness import base_run_dir
from coevolve.schedules.lockstep import LockstepConfig, LockstepLoop, TaskCycle
from coevolve.services.learner.config import LearnerConfig
from coevolve.shared.config import EngineKind
from coevolve.shared.messages import Task
from coevolve.shared.policy import load_policy
from coevolve.shared.policy.factory import engine_for_policy

Record = dict[str, Any]


def open_loop(
    tasks: Sequence[Task],
    config: LockstepConfig,
    learner: LearnerConfig,
    out: Path,
    *,
    engine: EngineKind = "transformers",
    threads: int | None = None,
    model: str | None = None,
    device: str | None = None,
) -> LockstepLoop:
    """A loop on ``tasks`` (shuffled rounds, ``config.seed``) with ``threads`` torch
    threads (None: ``OMP_NUM_THREADS``, else 1), the default policy (or ``model``) and
    ``engine`` sampling; TensorBoard under ``out/tensorboard``. Close it when done."""
    torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(config.seed)
    run_dir = base_run_dir()
    policy = load_policy(model, run_dir=run_dir, device=device)
    sampler = None
    if engine != "transformers":
        sampler = engine_for_policy(engine, policy, run_dir=run_dir, sequences=config.group_size)
    return LockstepLoop(
        policy,
        TaskCycle(tasks, seed=config.seed),
        config,
        learner,
        log_dir=out / "tensorboard",
        rollout_engine=sampler,
    )


def drive(
    rounds: int,
    play: Callable[[int], Record],
    describe: Callable[[Record], str],
    *,
    after: Callable[[list[Record]], object] | None = None,
    until: Callable[[list[Record]], bool] = lambda _: False,
) -> list[Record]:
    """Rounds 1..``rounds`` of ``play``, each described in a line, until ``until``."""
    records: list[Record] = []
    for index in range(1, rounds + 1):
        records.append(play(index))
        print(describe(records[-1]), flush=True)
        if after is not None:
            after(records)
        if until(records):
            break
    return records
