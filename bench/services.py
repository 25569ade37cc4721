"""Service-level benchmarks of ``coevolve up``: two phases, one after the other, compared.

``--compare schedule`` (the default): ``coevolve up`` against ``coevolve up --schedule
lockstep``. ``--compare data-loop``: ``coevolve up`` (``full``: the whole data loop)
against ``coevolve up --scale explorer=0`` (``no_data_loop``: no explorer, so no
exploration, abstraction or judging; signal-monitor still runs and the LLM server still
starts, idle): what the data loop costs the learner on this machine.

Both phases run as a user starts them (``python -m coevolve up``), on the same embedded
default configuration (so the same seeds), each in a fresh run directory
(``RUN_DIR/bench/services-<stamp>/<phase>``, sharing ``RUN_DIR/models``), for the same
wall time (schedule: 15 minutes each, data-loop: 30; 3 with ``--quick``; ``--minutes``
overrides), on the same cores: the whole machine. The clock of a phase starts when its
process is spawned, so model loading, the pool's seeding and the SFT warm start count
against both phases, as they would for a user. Both do their own warm start: the
learner service in an async ``up``, and ``warm_start_once``
(``coevolve.schedules.lockstep``) in the lockstep process, with the same
``learner.warm_start`` section.

- async, full, no_data_loop: ``coevolve up`` with a NATS server of its own on a free
  port; every service is a process with one torch thread (what ``up`` gives them), the
  local LLM server beside; they share the machine's cores.
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
- rollout groups: groups the rollout service produced and pool-store recorded (distinct
  ``group_id`` of the pool's ``rollout_results``, by ``recorded_at``); groups trained
  on: those the learner's step records (``RUN_DIR/learner/steps.jsonl``) name as trained;
- accepted tasks: rows of the run's ``pool.duckdb`` table ``verdicts`` (read-only, after
  the stop) created before the stop with ``accepted``; ``added`` says which were new to
  the pool;
- CPU seconds per part of the run (each service, ``llm``: the LLM server, ``nats``,
  ``up``), from the process tree sampled every few seconds (``CpuLedger``); the LLM
  server's share of all parts' CPU seconds and of wall time x cores; and
  ``llm_cpu_s_per_accepted``: the LLM server's CPU seconds per accepted task (role LLM
  calls carry no timing of their own; None when none was accepted).

Reported per phase: learner steps, steps per hour (from spawn, and from the first
learner step: ``steps_per_hour_from_first_step``), per hour and core, accepted tasks,
accepted per hour and per hour and core, verdicts, seconds from spawn to the warm
start's end and to the first learner step, and the CPU figures. Then
``learner_steps_per_hour_ratio``: the first phase's learner steps per hour over the
second's (async / lockstep, full / no_data_loop), from spawn, so the warm start counts
equally in both; ``learner_steps_per_hour_ratio_from_first_step`` leaves it out. Below 1
in the data-loop comparison: the data loop slows the learner by that factor. The
machine's CPU model, whether it has avx512_bf16, and its load average at each phase's
start are recorded: other work on the machine slows both phases, and unequally when it
changes between them.

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
from coevolve.bench.synthesis import cpu_info
from coevolve.processes import (
    CpuLedger,
    descendants,
    kill_leftovers,
    kill_survivors,
    share_model_cache,
    spawn_up,
    stop_process_group,
)
from coevolve.report.run_data import LEARNER_STEPS, read_scalars, read_steps
from coevolve.schedules.lockstep import WARM_START_CHECKPOINT
from coevolve.shared.config import DEFAULT_RUN_DIR
from coevolve.shared.llm.server import API_KEY_ENV, BASE_URL_ENV, MODEL_ENV
from coevolve.shared.runtime.credentials import CREDENTIALS_DIR_ENV
from coevolve.shared.runtime.nats_server import free_port

QUICK_MINUTES = 3.0
# each comparison: its two phases (the ratios are first / second) and its minutes per phase
COMPARISONS = {"schedule": ("async", "lockstep"), "data-loop": ("full", "no_data_loop")}
FULL_MINUTES = {"schedule": 15.0, "data-loop": 30.0}
# the data-loop comparison's baseline: `up` without explorers, so nothing is explored
NO_DATA_LOOP_SCALE = "explorer=0"
CPU_SAMPLE_EVERY_S = 5.0
# more than any run reaches: time ends a lockstep phase, not its iterations
LOCKSTEP_ITERATIONS = 1_000_000
STOP_GRACE_S = 60.0
TRAINED_TAG = "learner/trained"
# each schedule's GrpoLearner writes its scalars here (learner service / lockstep loop)
TENSORBOARD_DIRS = {
    "async": Path("tensorboard") / "learner",
    "full": Path("tensorboard") / "learner",
    "no_data_loop": Path("tensorboard") / "learner",
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


def up_options(phase: str, run_dir: Path, nats_port: int) -> list[str]:
    """``coevolve up``'s options of an async phase: ``no_data_loop`` starts no explorer."""
    options = ["--run-dir", str(run_dir), "--nats-port", str(nats_port)]
    return options + (["--scale", NO_DATA_LOOP_SCALE] if phase == "no_data_loop" else [])


def start_schedule(
    schedule: str, run_dir: Path, log_path: Path, cores: int
) -> subprocess.Popen[bytes]:
    """The phase's process in a process group of its own, its output in ``log_path``."""
    env = clean_environment()
    if schedule in ("async", "full", "no_data_loop"):
        options = up_options(schedule, run_dir, free_port())
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


def count_rollout_groups(db_path: Path, started_at: float, stopped_at: float) -> int:
    """Rollout groups pool-store recorded between the two times (Unix seconds), read-only."""
    if not db_path.is_file():
        return 0
    with contextlib.closing(duckdb.connect(str(db_path), read_only=True)) as db:
        row = db.execute(
            "SELECT count(DISTINCT group_id) FROM rollout_results "
            "WHERE recorded_at BETWEEN ? AND ?",
            [started_at, stopped_at],
        ).fetchone()
    return int(row[0]) if row else 0


def count_groups_trained_on(run_dir: Path, started_at: float, stopped_at: float) -> int:
    """Groups the learner's steps between the two times trained on (``steps.jsonl``)."""
    records = read_steps(run_dir / LEARNER_STEPS)
    return sum(len(r.groups) for r in records if started_at <= r.at <= stopped_at)


def warm_start_done_s(schedule: str, run_dir: Path, started_at: float) -> float | None:
    """Seconds from spawn to the warm start's end: the async learner then writes policy
    v1, the lockstep process its warm-start checkpoint."""
    marker = (
        run_dir / WARM_START_CHECKPOINT
        if schedule == "lockstep"
        else run_dir / "policies" / "v1.safetensors"
    )
    try:
        return round(marker.stat().st_mtime - started_at, 1)
    except OSError:
        return None


def per_hour(count: int, seconds: float) -> float:
    return round(count * 3600 / seconds, 2) if seconds > 0 else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def phase_figures(
    learner: LearnerCount, verdicts: VerdictCount, wall_s: float, cores: int
) -> dict[str, Any]:
    """The rates of one phase, in total and per core."""
    steps_per_hour = per_hour(learner.steps, wall_s)
    accepted_per_hour = per_hour(verdicts.accepted, wall_s)
    first = learner.first_step_s
    training_s = wall_s - first if first is not None else 0.0
    return {
        "learner_steps": learner.steps,
        "steps_per_hour": steps_per_hour,
        # the same steps over the time since the first one: without the warm start
        "steps_per_hour_from_first_step": per_hour(learner.steps, training_s)
        if training_s > 0
        else None,
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


def cpu_figures(
    cpu_seconds: Mapping[str, float], wall_s: float, cores: int, accepted: int
) -> dict[str, Any]:
    """CPU seconds per part, the LLM server's share of them and of the machine (wall time
    x cores), and its CPU seconds per accepted task (None when none was accepted)."""
    llm = cpu_seconds.get("llm", 0.0)
    total = sum(cpu_seconds.values())
    return {
        "cpu_seconds": dict(cpu_seconds),
        "cpu_seconds_total": round(total, 1),
        "llm_cpu_s": round(llm, 1),
        "llm_cpu_share_of_parts": ratio(llm, total),
        "llm_cpu_share_of_machine": ratio(llm, wall_s * cores),
        "llm_cpu_s_per_accepted": round(llm / accepted, 1) if accepted else None,
    }


def ratios(
    phases: Mapping[str, Mapping[str, Any]], names: tuple[str, str] = COMPARISONS["schedule"]
) -> dict[str, float | None]:
    """first / second phase of each rate (None where the second has none)."""
    fast, slow = phases[names[0]], phases[names[1]]
    return {key: ratio(fast[key], slow[key]) for key in ("steps_per_hour", "accepted_per_hour")}


def learner_step_ratios(
    first: Mapping[str, Any], second: Mapping[str, Any]
) -> dict[str, float | None]:
    """Learner steps per hour, first phase / second: from spawn (the main ratio: the warm
    start counts equally in both) and from each phase's first step; None where either
    phase has no such rate (not run, or no step)."""
    return {
        f"learner_steps_per_hour_ratio{suffix}": ratio(
            first.get(f"steps_per_hour{suffix}"), second.get(f"steps_per_hour{suffix}")
        )
        for suffix in ("", "_from_first_step")
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
    cpu = CpuLedger()
    next_sample = started
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if time.monotonic() >= next_sample:
                cpu.sample(process.pid)
                next_sample += CPU_SAMPLE_EVERY_S
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        interrupted = True
        print(f"[services] interrupted: stopping {schedule}", flush=True)
    finally:
        cpu.sample(process.pid)  # what each part used until the stop
        wall_s = time.monotonic() - started
        stopped_at = started_at + wall_s
        exited_early = process.poll() is not None
        tree = descendants(process.pid)
        shutdown = stop_process_group(process, STOP_GRACE_S)
        killed = kill_survivors(tree) + kill_leftovers(str(run_dir))
    learner = count_learner_steps(run_dir / TENSORBOARD_DIRS[schedule], started_at, stopped_at)
    pool = run_dir / "pool.duckdb"
    verdicts = count_verdicts(pool, started_at, stopped_at)
    result: dict[str, Any] = {
        "phase": schedule,
        "schedule": "lockstep" if schedule == "lockstep" else "async",
        "wall_s": round(wall_s, 1),
        "cores": cores,
        **phase_figures(learner, verdicts, wall_s, cores),
        "rollout_groups": count_rollout_groups(pool, started_at, stopped_at),
        "groups_trained_on": count_groups_trained_on(run_dir, started_at, stopped_at),
        **cpu_figures(cpu.totals(), wall_s, cores, verdicts.accepted),
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
    if schedule != "lockstep":
        versions = policy_versions(run_dir)
        result["policy_files"] = len(versions)
        result["grpo_policy_files"] = sum(1 for v in versions if v >= 2)
    return result


# ---------------------------------------------------------------------- the benchmark


def run(
    quick: bool = False,
    minutes: float | None = None,
    base_run_dir: Path | None = None,
    compare: str = "schedule",
) -> dict[str, Any]:
    if compare not in COMPARISONS:
        raise ValueError(f"--compare takes one of {', '.join(COMPARISONS)}, not {compare!r}")
    names = COMPARISONS[compare]
    if minutes is None:
        minutes = QUICK_MINUTES if quick else FULL_MINUTES[compare]
    if minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {minutes}")
    base = base_run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    out = (base / "bench" / f"services-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = machine_cores()
    phases: dict[str, dict[str, Any]] = {}
    for name in names:
        phases[name] = run_phase(name, out, base, minutes, cores)
        if phases[name]["stop"]["interrupted"]:
            break
    done = len(phases) == len(names)
    over = f"{names[0]}_over_{names[1]}"
    result: dict[str, Any] = {
        "benchmark": "services",
        "compare": compare,
        "quick": quick,
        "minutes_per_phase": minutes,
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_info(),
        "load_average_at_start": {k: v["load_average_at_start"] for k, v in phases.items()},
        "phases": phases,
        over: ratios(phases, names) if done else None,
        **learner_step_ratios(phases.get(names[0], {}), phases.get(names[1], {})),
        "bench_dir": str(out),
    }
    if compare == "schedule":
        result["lockstep_iterations_asked"] = LOCKSTEP_ITERATIONS
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def _cell(value: object, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


def print_table(result: Mapping[str, Any]) -> None:
    cores = result["cores"]
    names = COMPARISONS[result["compare"]]
    rows = (
        ("learner steps", "learner_steps", ""),
        ("steps / hour (from spawn)", "steps_per_hour", ""),
        ("steps / hour from first step", "steps_per_hour_from_first_step", ""),
        (f"steps / hour / core ({cores})", "steps_per_hour_per_core", ""),
        ("rollout groups (pool)", "rollout_groups", ""),
        ("groups trained on", "groups_trained_on", ""),
        ("accepted tasks", "accepted_tasks", ""),
        ("  of them new to the pool", "accepted_and_new", ""),
        ("verdicts", "verdicts", ""),
        ("accepted / hour", "accepted_per_hour", ""),
        (f"accepted / hour / core ({cores})", "accepted_per_hour_per_core", ""),
        ("warm start done", "warm_start_done_s", " s"),
        ("first learner step", "first_step_s", " s"),
        ("first accepted task", "first_accepted_s", " s"),
        ("CPU, all parts", "cpu_seconds_total", " s"),
        ("CPU, LLM server", "llm_cpu_s", " s"),
        ("LLM share of all parts' CPU", "llm_cpu_share_of_parts", ""),
        (f"LLM share of wall x {cores} cores", "llm_cpu_share_of_machine", ""),
        ("LLM CPU / accepted task", "llm_cpu_s_per_accepted", " s"),
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
    r = result[f"{names[0]}_over_{names[1]}"]
    if r is not None:
        lines.append(
            f"{names[0]} / {names[1]}: steps per hour {_cell(r['steps_per_hour'])} from spawn, "
            f"{_cell(result['learner_steps_per_hour_ratio_from_first_step'])} from the first "
            f"step; accepted per hour {_cell(r['accepted_per_hour'])} (same cores, so per "
            "core too)"
        )
    cpu = result["cpu"]
    lines.append(f"CPU {cpu['model']}, avx512_bf16 {cpu['avx512_bf16']}")
    lines.append(f"result: {result['bench_dir']}/result.json")
    tables.print_table(
        f"coevolve up, {names[0]} vs {names[1]}: {result['minutes_per_phase']:g} min each "
        f"from spawn, {cores} cores each, embedded defaults",
        ("", *phases),
        [
            (label, *(_cell(phase.get(key), suffix) for phase in phases.values()))
            for label, key, suffix in rows
        ],
        note="\n".join(lines),
    )


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
