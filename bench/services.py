"""Service-level schedule benchmark: ``coevolve up`` against ``coevolve up --schedule lockstep``.

Both schedules run one after the other, as a user starts them (``python -m coevolve up``),
on the same embedded default configuration, each in a fresh run directory
(``RUN_DIR/bench/services-<stamp>/{async,lockstep}``), for the same wall time (15 minutes
each; 3 with ``--quick``; ``--minutes`` overrides both), on the same cores: the whole
machine. The clock of a phase starts when its process is spawned, so model loading, the
pool's seeding and the SFT warm start count against both schedules, as they would for a
user. Both do their own warm start: the learner service in the async schedule, and
``warm_start_once`` (``coevolve.schedules.lockstep``) in the lockstep process, with the
same ``learner.warm_start`` section.

- async: ``coevolve up`` with a NATS server of its own on a free port; every service is a
  process with one torch thread (what ``up`` gives them), the local LLM server beside;
  they share the machine's cores.
- lockstep: ``coevolve up --schedule lockstep`` with ``--iterations`` too large to finish
  (time ends the phase, not the iterations) and one torch thread per core, so the one
  process has the same cores; its data loop (signals, explore, abstract, judge) runs
  after every learner step (``--synthesize-every 1``, the default), with the same LLM
  roles on a local server of its own.

At the end of a phase its process group gets SIGINT (both handle it: stop, then exit),
SIGKILL after a grace period; the processes it had started and any process carrying the
run directory in its command line are SIGKILLed if still there. Only what finished
within the phase's wall time counts:

- learner steps: the learner's TensorBoard scalar ``learner/trained`` (one event per
  ``GrpoLearner.step`` in both schedules, 1.0 when the optimizer stepped), events up to
  the stop; a step is one that trained. For async the policy files
  ``RUN_DIR/policies/v<N>.safetensors`` (v1: the warm start; every trained step writes
  the next) are a cross-check;
- accepted tasks: rows of the run's ``pool.duckdb`` table ``verdicts`` (read-only, after
  the stop) created before the stop with ``accepted``; ``added`` says which were new to
  the pool.

Reported per schedule: learner steps, steps per hour and per hour and core, accepted
tasks, accepted per hour and per hour and core, verdicts, seconds from spawn to the warm
start's end and to the first learner step; then the ratios async / lockstep. The
machine's load average at each phase's start is recorded: other work on the machine
slows both phases, and unequally when it changes between them.

Writes ``result.json`` and each phase's log to ``RUN_DIR/bench/services-<stamp>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from coevolve.bench import tables
from coevolve.bench.dataloop import policy_versions, pool_summary
from coevolve.processes import (
    descendants,
    kill_leftovers,
    kill_survivors,
    share_model_cache,
    spawn_up,
    stop_process_group,
)
from coevolve.report.run_data import read_scalars
from coevolve.schedules.lockstep import WARM_START_CHECKPOINT
from coevolve.shared.config import DEFAULT_RUN_DIR
from coevolve.shared.llm.server import API_KEY_ENV, BASE_URL_ENV, MODEL_ENV
from coevolve.shared.runtime.credentials import CREDENTIALS_DIR_ENV
from coevolve.shared.runtime.nats_server import free_port

FULL_MINUTES = 15.0
QUICK_MINUTES = 3.0
SCHEDULES = ("async", "lockstep")
# more than any run reaches: time ends a lockstep phase, not its iterations
LOCKSTEP_ITERATIONS = 1_000_000
STOP_GRACE_S = 60.0
TRAINED_TAG = "learner/trained"
# each schedule's GrpoLearner writes its scalars here (learner service / lockstep loop)
TENSORBOARD_DIRS = {
    "async": Path("tensorboard") / "learner",
    "lockstep": Path("tensorboard") / "lockstep",
}
# settings a caller's shell may hold that would point a phase at someone else's run
INHERITED = (
    "NATS_URL",
    "COEVOLVE_CONFIG",
    "COEVOLVE_RUN_DIR",
    "OMP_NUM_THREADS",
    CREDENTIALS_DIR_ENV,
    BASE_URL_ENV,
    API_KEY_ENV,
    MODEL_ENV,
)


def machine_cores() -> int:
    """The cores this process may run on: what each schedule gets."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def clean_environment(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in INHERITED}


def lockstep_argv(run_dir: Path, iterations: int = LOCKSTEP_ITERATIONS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "coevolve",
        "up",
        "--schedule",
        "lockstep",
        "--run-dir",
        str(run_dir),
        "--iterations",
        str(iterations),
    ]


def start_schedule(
    schedule: str, run_dir: Path, log_path: Path, cores: int
) -> subprocess.Popen[bytes]:
    """The schedule's process in a process group of its own, its output in ``log_path``."""
    env = clean_environment()
    if schedule == "async":
        options = ["--run-dir", str(run_dir), "--nats-port", str(free_port())]
        return spawn_up(options, env, log_path)  # one torch thread per service, as up gives
    if schedule != "lockstep":
        raise ValueError(f"unknown schedule {schedule!r}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    environment = {**env, "OMP_NUM_THREADS": str(cores), "HF_HUB_OFFLINE": "1"}
    with log_path.open("ab") as log:
        return subprocess.Popen(
            lockstep_argv(run_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )


# ---------------------------------------------------------------------- processes


# ---------------------------------------------------------------------- counting


@dataclass(frozen=True)
class LearnerCount:
    steps: int  # trained (optimizer stepped) before the stop
    calls: int  # GrpoLearner.step calls before the stop, trained or not
    first_step_s: float | None  # from spawn to the first trained step


def count_learner_steps(
    tensorboard_dir: Path, started_at: float, stopped_at: float
) -> LearnerCount:
    """Learner steps from the ``learner/trained`` scalars written between the two times
    (Unix seconds)."""
    events = [
        event
        for event in read_scalars(tensorboard_dir).get(TRAINED_TAG, [])
        if started_at <= event.wall_time <= stopped_at
    ]
    trained = sorted(event.wall_time for event in events if event.value > 0)
    first = round(trained[0] - started_at, 1) if trained else None
    return LearnerCount(steps=len(trained), calls=len(events), first_step_s=first)


@dataclass(frozen=True)
class VerdictCount:
    verdicts: int
    accepted: int
    accepted_and_new: int
    first_accepted_s: float | None


def count_verdicts(db_path: Path, started_at: float, stopped_at: float) -> VerdictCount:
    """Verdicts created between the two times (Unix seconds), from the pool file, read-only."""
    if not db_path.is_file():
        return VerdictCount(0, 0, 0, None)
    with contextlib.closing(duckdb.connect(str(db_path), read_only=True)) as db:
        row = db.execute(
            "SELECT count(*), count(*) FILTER (WHERE accepted), "
            "count(*) FILTER (WHERE accepted AND added), min(created_at) FILTER (WHERE accepted) "
            "FROM verdicts WHERE created_at BETWEEN ? AND ?",
            [started_at, stopped_at],
        ).fetchone()
    total, accepted, added, first = row or (0, 0, 0, None)
    return VerdictCount(
        int(total),
        int(accepted),
        int(added),
        None if first is None else round(float(first) - started_at, 1),
    )


def warm_start_done_s(schedule: str, run_dir: Path, started_at: float) -> float | None:
    """Seconds from spawn to the warm start's end: the async learner then writes policy
    v1, the lockstep process its warm-start checkpoint."""
    marker = (
        run_dir / "policies" / "v1.safetensors"
        if schedule == "async"
        else run_dir / WARM_START_CHECKPOINT
    )
    try:
        return round(marker.stat().st_mtime - started_at, 1)
    except OSError:
        return None


def per_hour(count: int, seconds: float) -> float:
    return round(count * 3600 / seconds, 2) if seconds > 0 else 0.0


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def phase_figures(
    learner: LearnerCount, verdicts: VerdictCount, wall_s: float, cores: int
) -> dict[str, Any]:
    """The rates of one phase, in total and per core."""
    steps_per_hour = per_hour(learner.steps, wall_s)
    accepted_per_hour = per_hour(verdicts.accepted, wall_s)
    return {
        "learner_steps": learner.steps,
        "steps_per_hour": steps_per_hour,
        "steps_per_hour_per_core": round(steps_per_hour / cores, 2),
        "accepted_tasks": verdicts.accepted,
        "accepted_per_hour": accepted_per_hour,
        "accepted_per_hour_per_core": round(accepted_per_hour / cores, 2),
        "accepted_and_new": verdicts.accepted_and_new,
        "verdicts": verdicts.verdicts,
        "first_step_s": learner.first_step_s,
        "first_accepted_s": verdicts.first_accepted_s,
        "learner_calls": learner.calls,
    }


def ratios(phases: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """async / lockstep of each rate (None where lockstep has none)."""
    fast, slow = phases["async"], phases["lockstep"]
    return {
        key: ratio(float(fast[key]), float(slow[key]))
        for key in ("steps_per_hour", "accepted_per_hour")
    }


# ---------------------------------------------------------------------- one phase


def run_phase(
    schedule: str, bench_dir: Path, base: Path, minutes: float, cores: int
) -> dict[str, Any]:
    run_dir = bench_dir / schedule
    log_path = bench_dir / f"{schedule}.log"
    shared_models = share_model_cache(run_dir, base)
    load = os.getloadavg()
    print(f"[services] {schedule}: {minutes:g} min on {cores} cores; run directory {run_dir}")
    started_at = time.time()
    started = time.monotonic()
    process = start_schedule(schedule, run_dir, log_path, cores)
    deadline = started + minutes * 60
    interrupted = False
    try:
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        interrupted = True
        print(f"[services] interrupted: stopping {schedule}", flush=True)
    finally:
        wall_s = time.monotonic() - started
        stopped_at = started_at + wall_s
        exited_early = process.poll() is not None
        tree = descendants(process.pid)
        shutdown = stop_process_group(process, STOP_GRACE_S)
        killed = kill_survivors(tree) + kill_leftovers(str(run_dir))
    learner = count_learner_steps(run_dir / TENSORBOARD_DIRS[schedule], started_at, stopped_at)
    verdicts = count_verdicts(run_dir / "pool.duckdb", started_at, stopped_at)
    pool = run_dir / "pool.duckdb"
    result: dict[str, Any] = {
        "schedule": schedule,
        "wall_s": round(wall_s, 1),
        "cores": cores,
        **phase_figures(learner, verdicts, wall_s, cores),
        "warm_start_done_s": warm_start_done_s(schedule, run_dir, started_at),
        "load_average_at_start": [round(x, 2) for x in load],
        "shared_model_cache": shared_models,
        "pool": pool_summary(pool) if pool.is_file() else None,
        "stop": {
            "exited_early": exited_early,
            "interrupted": interrupted,
            "graceful": shutdown.graceful,
            "returncode": shutdown.returncode,
            "stop_s": shutdown.seconds,
            "killed_after_stop": killed,
        },
        "log": str(log_path),
        "run_dir": str(run_dir),
    }
    if schedule == "async":
        versions = policy_versions(run_dir)
        result["policy_files"] = len(versions)
        result["grpo_policy_files"] = sum(1 for v in versions if v >= 2)
    return result


# ---------------------------------------------------------------------- the benchmark


def run(
    quick: bool = False, minutes: float | None = None, base_run_dir: Path | None = None
) -> dict[str, Any]:
    minutes = minutes if minutes is not None else (QUICK_MINUTES if quick else FULL_MINUTES)
    if minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {minutes}")
    base = base_run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    out = (base / "bench" / f"services-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = machine_cores()
    phases: dict[str, dict[str, Any]] = {}
    for schedule in SCHEDULES:
        phases[schedule] = run_phase(schedule, out, base, minutes, cores)
        if phases[schedule]["stop"]["interrupted"]:
            break
    result: dict[str, Any] = {
        "benchmark": "services",
        "quick": quick,
        "minutes_per_phase": minutes,
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "lockstep_iterations_asked": LOCKSTEP_ITERATIONS,
        "phases": phases,
        "async_over_lockstep": ratios(phases) if len(phases) == len(SCHEDULES) else None,
        "bench_dir": str(out),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def _cell(value: object, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


def print_table(result: Mapping[str, Any]) -> None:
    cores = result["cores"]
    rows = (
        ("learner steps", "learner_steps", ""),
        ("steps / hour", "steps_per_hour", ""),
        (f"steps / hour / core ({cores})", "steps_per_hour_per_core", ""),
        ("accepted tasks", "accepted_tasks", ""),
        ("  of them new to the pool", "accepted_and_new", ""),
        ("verdicts", "verdicts", ""),
        ("accepted / hour", "accepted_per_hour", ""),
        (f"accepted / hour / core ({cores})", "accepted_per_hour_per_core", ""),
        ("warm start done", "warm_start_done_s", " s"),
        ("first learner step", "first_step_s", " s"),
        ("first accepted task", "first_accepted_s", " s"),
        ("wall time", "wall_s", " s"),
    )
    phases = result["phases"]
    lines = []
    for name, phase in phases.items():
        stop = phase["stop"]
        how = "gracefully" if stop["graceful"] else "by SIGKILL"
        early = ", exited early" if stop["exited_early"] else ""
        lines.append(
            f"{name}: stopped {how} in {stop['stop_s']} s (exit {stop['returncode']}{early}); "
            f"load average at start {phase['load_average_at_start'][0]}; log {phase['log']}"
        )
    if result["async_over_lockstep"] is not None:
        r = result["async_over_lockstep"]
        lines.append(
            f"async / lockstep: steps per hour {_cell(r['steps_per_hour'])}, "
            f"accepted per hour {_cell(r['accepted_per_hour'])} (same cores, so per core too)"
        )
    lines.append(f"result: {result['bench_dir']}/result.json")
    tables.print_table(
        f"coevolve up, async vs lockstep: {result['minutes_per_phase']:g} min each from spawn, "
        f"{cores} cores each, embedded defaults",
        ("", *phases),
        [
            (label, *(_cell(phase.get(key), suffix) for phase in phases.values()))
            for label, key, suffix in rows
        ],
        note="\n".join(lines),
    )


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
