"""Schedule benchmark: learner steps per hour, asynchronous against lockstep, same run.

Both schedules run the same work with the same settings: the default policy (LoRA), short
BFCL MathAPI tasks (``short_tasks``), ``tasks_per_step`` groups of K episodes per learner
step, on the same cores (0 and 1) with the same number of torch threads in all (two):

- lockstep: one process on both cores with two torch threads: rollout, then
  ``GrpoLearner.step``, in turn (``coevolve.schedules.lockstep.LockstepLoop``);
- async: a rollout process pinned to core 0 and a learner process pinned to core 1, one
  torch thread each. The rollout process produces batches of groups without waiting and
  puts them on a bounded queue (it blocks when ``queue_bound`` batches are unconsumed:
  backpressure); the learner takes one batch per step and after each step writes its new
  adapter weights to a file (atomic rename), which the rollout loads between batches (hot
  swap), so groups may be a version or two stale (the learner's staleness bound applies,
  drops are counted).

Both rates are also given per core (steps per hour / cores).

Timing starts once every process has loaded its model. Steps whose groups all have equal
rewards still run the full forward/backward (``drop_uniform_groups=False``): the base
model earns 0 everywhere, and a skipped step would measure nothing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import msgspec

from coevolve.bench import tables
from coevolve.shared.config import DEFAULT_RUN_DIR
from coevolve.shared.messages import RolloutGroup

ROLLOUT_CORE = 0
LEARNER_CORE = 1
CORES = (ROLLOUT_CORE, LEARNER_CORE)  # what each schedule gets, and its torch threads in all


@dataclass(frozen=True)
class Setup:
    steps: int
    tasks_per_step: int
    group_size: int
    max_new_tokens: int
    train_tasks: int = 12
    queue_bound: int = 2
    max_steps: int = 2
    seed: int = 0


QUICK = Setup(steps=2, tasks_per_step=1, group_size=2, max_new_tokens=16, train_tasks=4)
FULL = Setup(steps=10, tasks_per_step=2, group_size=4, max_new_tokens=48)

_groups_codec = msgspec.msgpack.Encoder()


def _prepare(cores: tuple[int, ...]) -> None:
    """Pin this process to ``cores`` (those the machine has) with a torch thread each."""
    present = {core for core in cores if core < (os.cpu_count() or 1)} or {0}
    os.environ["OMP_NUM_THREADS"] = str(len(present))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, present)
    import torch

    torch.set_num_threads(len(present))
    torch.manual_seed(0)


def _policy_run_dir() -> Path:
    return Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)


def _learner_config() -> Any:
    from coevolve.services.learner.config import LearnerConfig

    return LearnerConfig(drop_uniform_groups=False)


def _lockstep_config(setup: Setup) -> Any:
    from coevolve.schedules.lockstep import LockstepConfig

    return LockstepConfig(
        tasks_per_step=setup.tasks_per_step,
        group_size=setup.group_size,
        max_new_tokens=setup.max_new_tokens,
        max_steps=setup.max_steps,
        seed=setup.seed,
    )


def lockstep_worker(setup: Setup, results: mp.Queue) -> None:
    _prepare(CORES)
    from coevolve.bench.short_tasks import build_tasks
    from coevolve.schedules.lockstep import LockstepLoop, TaskCycle
    from coevolve.shared.policy import load_policy

    tasks = build_tasks(setup.train_tasks, setup.seed, "math_train")
    policy = load_policy(run_dir=_policy_run_dir())
    loop = LockstepLoop(
        policy, TaskCycle(tasks, setup.seed), _lockstep_config(setup), _learner_config()
    )
    started = time.perf_counter()
    reports = loop.run(setup.steps)
    wall = time.perf_counter() - started
    results.put(
        {
            "wall_s": wall,
            "steps": len(reports),
            "rollout_s": sum(r.rollout_s for r in reports),
            "learn_s": sum(r.learn_s for r in reports),
        }
    )


@dataclass(frozen=True)
class Link:
    """What the async rollout and learner processes share: the queue of batches, the
    weights file, the start and stop events and the queue of reports."""

    groups: mp.Queue
    weights_path: str
    start: Event
    stop: Event
    results: mp.Queue


def rollout_worker(setup: Setup, link: Link, ready: Event) -> None:
    _prepare((ROLLOUT_CORE,))
    from coevolve.bench.short_tasks import build_tasks
    from coevolve.schedules.lockstep import TaskCycle, collect_groups
    from coevolve.shared.policy import SamplingParams, TransformersEngine, load_policy

    tasks = TaskCycle(build_tasks(setup.train_tasks, setup.seed, "math_train"), setup.seed)
    engine = TransformersEngine(load_policy(run_dir=_policy_run_dir()))
    ready.set()
    link.start.wait()
    produced = swaps = 0
    generate_s = 0.0
    blocked_s = 0.0
    while not link.stop.is_set():
        latest = _read_weights(link.weights_path)
        if latest is not None and latest[0] > engine.policy_version:
            engine.load_weights(latest[1], latest[0])
            swaps += 1
        params = SamplingParams(max_new_tokens=setup.max_new_tokens, temperature=1.0, seed=produced)
        begun = time.perf_counter()
        batch = collect_groups(
            engine, tasks(setup.tasks_per_step), setup.group_size, params, setup.max_steps
        )
        generate_s += time.perf_counter() - begun
        payload = _groups_codec.encode(batch)
        begun = time.perf_counter()
        while not link.stop.is_set():
            try:
                link.groups.put(payload, timeout=0.2)
                produced += 1
                break
            except queue.Full:
                continue
        blocked_s += time.perf_counter() - begun
    # batches still queued for a learner that has stopped: drop them at exit instead of
    # waiting forever for the queue's feeder thread to hand them over
    link.groups.cancel_join_thread()
    link.results.put(
        {
            "role": "rollout",
            "batches": produced,
            "weight_swaps": swaps,
            "rollout_s": generate_s,
            "blocked_s": blocked_s,
        }
    )


def learner_worker(setup: Setup, link: Link, ready: Event) -> None:
    _prepare((LEARNER_CORE,))
    from coevolve.services.learner.trainer import GrpoLearner
    from coevolve.shared.policy import load_policy

    learner = GrpoLearner(load_policy(run_dir=_policy_run_dir()), _learner_config())
    ready.set()
    link.start.wait()
    started = time.perf_counter()
    learn_s = waited_s = 0.0
    dropped = 0
    staleness: list[float] = []
    for _ in range(setup.steps):
        begun = time.perf_counter()
        batch = msgspec.msgpack.decode(link.groups.get(), type=list[RolloutGroup])
        waited_s += time.perf_counter() - begun
        begun = time.perf_counter()
        metrics = learner.step(batch)
        _write_weights(link.weights_path, learner.version, learner.export_weights())
        learn_s += time.perf_counter() - begun
        dropped += metrics.dropped_stale
        staleness.append(metrics.staleness_mean)
    wall = time.perf_counter() - started
    link.stop.set()
    link.results.put(
        {
            "role": "learner",
            "wall_s": wall,
            "steps": setup.steps,
            "learn_s": learn_s,
            "waited_s": waited_s,
            "dropped_stale": dropped,
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
        }
    )


def _write_weights(path: str, version: int, blob: bytes) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(struct.pack("<Q", version))
        handle.write(blob)
    os.replace(temporary, path)


def _read_weights(path: str) -> tuple[int, bytes] | None:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return struct.unpack("<Q", data[:8])[0], data[8:]


def run_lockstep(setup: Setup) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=lockstep_worker, args=(setup, results))
    worker.start()
    result: dict[str, Any] = results.get()
    worker.join()
    return result


def run_async(setup: Setup) -> dict[str, Any]:
    context = mp.get_context("spawn")
    groups = context.Queue(maxsize=setup.queue_bound)
    results = context.Queue()
    start, stop = context.Event(), context.Event()
    readies = [context.Event(), context.Event()]
    with tempfile.TemporaryDirectory() as scratch:
        link = Link(groups, str(Path(scratch) / "weights.bin"), start, stop, results)
        workers = [
            context.Process(target=target, args=(setup, link, ready))
            for target, ready in zip((rollout_worker, learner_worker), readies, strict=True)
        ]
        for worker in workers:
            worker.start()
        for ready in readies:
            ready.wait()
        start.set()
        reports = {r["role"]: r for r in (results.get(), results.get())}
        for worker in workers:
            worker.join(timeout=60)
        for worker in workers:
            if worker.is_alive():  # reported, but stuck on its way out: do not hang the bench
                worker.terminate()
                worker.join(timeout=10)
    learner = reports["learner"]
    return {**learner, "rollout": reports["rollout"]}


def run(quick: bool, setup: Setup | None = None) -> dict[str, Any]:
    setup = setup or (QUICK if quick else FULL)
    started = time.perf_counter()
    lockstep = run_lockstep(setup)
    asynchronous = run_async(setup)
    lockstep_rate = 3600 * lockstep["steps"] / lockstep["wall_s"]
    async_rate = 3600 * asynchronous["steps"] / asynchronous["wall_s"]
    cores = len({core for core in CORES if core < (os.cpu_count() or 1)} or {0})
    result: dict[str, Any] = {
        "benchmark": "schedule",
        "quick": quick,
        "setup": asdict(setup),
        # same cores and same torch threads in all for both schedules
        "cores": {
            "lockstep": list(CORES),
            "async_rollout": [ROLLOUT_CORE],
            "async_learner": [LEARNER_CORE],
        },
        "torch_threads": {"lockstep": cores, "async_rollout": 1, "async_learner": 1},
        "cpu_count": os.cpu_count(),
        "lockstep_steps_per_hour": round(lockstep_rate, 1),
        "async_steps_per_hour": round(async_rate, 1),
        "lockstep_steps_per_core_hour": round(lockstep_rate / cores, 1),
        "async_steps_per_core_hour": round(async_rate / cores, 1),
        "ratio_async_over_lockstep": round(async_rate / lockstep_rate, 3),
        "lockstep": {k: round(v, 2) if isinstance(v, float) else v for k, v in lockstep.items()},
        "async": {
            k: (
                {a: round(b, 2) if isinstance(b, float) else b for a, b in v.items()}
                if isinstance(v, dict)
                else round(v, 2)
                if isinstance(v, float)
                else v
            )
            for k, v in asynchronous.items()
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    tables.print_table(
        None,
        ("schedule", "cores", "steps", "wall s", "steps/h", "per core"),
        [
            (
                name,
                cores,
                report["steps"],
                f"{report['wall_s']:.1f}",
                f"{rate:.1f}",
                f"{rate / cores:.1f}",
            )
            for name, report, rate in (
                ("lockstep", lockstep, lockstep_rate),
                ("async", asynchronous, async_rate),
            )
        ],
        note=f"async / lockstep (same cores, same threads): {result['ratio_async_over_lockstep']}",
    )
    return result


if __name__ == "__main__":
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
