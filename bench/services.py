"""Service-level benchmarks of ``coevolve up``: two phases, one after the other, compared.

``--compare schedule`` (the default): ``coevolve up`` (async) against ``coevolve up
--schedule lockstep``. ``--compare data-loop``: ``coevolve up`` (``full``) against ``up
--scale explorer=0`` (``no_data_loop``: nothing explored, abstracted or judged): what the
data loop costs the learner. Each phase is a run on the harness (``coevolve.harness``) on
the embedded defaults in a fresh run directory (``RUN_DIR/bench/services-<stamp>/<phase>``)
for the same wall time (schedule: 15 minutes each, data-loop: 30; 3 with ``--quick``;
``--minutes`` overrides) on the whole machine, counted from the spawn, so loading, seeding
and the warm start count against both. Async services get one torch thread each, the
lockstep process one per core (its data loop after every step, on an LLM server of its own).

Counted within each phase (``coevolve.run_figures``): learner steps that trained (the
``learner/trained`` TensorBoard events of ``GrpoLearner.step``), rollout groups, groups
trained on, accepted tasks (and those new to the pool), CPU seconds per part of the run
and the LLM server's share of them and of wall time x cores; per hour and per hour and
core, with the seconds to the warm start's end, the first step and the first accepted
task. ``learner_steps_per_hour_ratio``: first phase / second, from the spawn
(``..._from_first_step``: without the warm start); below 1 in the data-loop comparison,
the data loop slows the learner. The CPU model and each phase's starting load average are
recorded. Writes ``result.json`` and each phase's log to ``RUN_DIR/bench/services-<stamp>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coevolve.bench import tables
from coevolve.bench.synthesis import cpu_info
from coevolve.harness import LOCKSTEP_ITERATIONS, UpRun, machine_cores, output_dir
from coevolve.harness import base_run_dir as default_base
from coevolve.report.run_data import LEARNER_TENSORBOARD, TENSORBOARD
from coevolve.run_figures import LearnerCount, VerdictCount, run_figures
from coevolve.schedules.lockstep import WARM_START_CHECKPOINT

QUICK_MINUTES = 3.0
# each comparison: its two phases (the ratios are first / second) and its minutes per phase
COMPARISONS = {"schedule": ("async", "lockstep"), "data-loop": ("full", "no_data_loop")}
FULL_MINUTES = {"schedule": 15.0, "data-loop": 30.0}
# the data-loop comparison's baseline: `up` without explorers, so nothing is explored
NO_DATA_LOOP_SCALE = "explorer=0"
# each schedule's GrpoLearner writes its scalars here (learner service / lockstep loop)
TENSORBOARD_DIRS = {
    "async": LEARNER_TENSORBOARD,
    "full": LEARNER_TENSORBOARD,
    "no_data_loop": LEARNER_TENSORBOARD,
    "lockstep": f"{TENSORBOARD}/lockstep",
}


def phase_scale(phase: str) -> list[str]:
    """``coevolve up``'s --scale values of a phase: ``no_data_loop`` starts no explorer."""
    return [NO_DATA_LOOP_SCALE] if phase == "no_data_loop" else []


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


def run_phase(
    phase: str, bench_dir: Path, base: Path, minutes: float, cores: int
) -> dict[str, Any]:
    """One phase on the harness: spawned, run for ``minutes``, stopped, counted."""
    run_dir = bench_dir / phase
    load = os.getloadavg()
    print(f"[services] {phase}: {minutes:g} min on {cores} cores; run directory {run_dir}")
    lockstep = phase == "lockstep"
    # async: one torch thread per service, as up gives them; lockstep: one per core
    with UpRun.start(
        run_dir,
        bench_dir / f"{phase}.log",
        scale=phase_scale(phase),
        lockstep=lockstep,
        threads=cores if lockstep else 1,
        base=base,
    ) as run:
        ended = run.wait(seconds=minutes * 60)
        if ended == "interrupted":
            print(f"[services] interrupted: stopping {phase}", flush=True)
        run.stop()
    wall_s = run.elapsed_s()
    started_at = run.started_at
    figures = run_figures(run_dir, started_at, started_at + wall_s, TENSORBOARD_DIRS[phase])
    verdicts: VerdictCount = figures["verdicts"]
    result: dict[str, Any] = {
        "phase": phase,
        "schedule": "lockstep" if lockstep else "async",
        "wall_s": round(wall_s, 1),
        "cores": cores,
        **phase_figures(figures["learner"], verdicts, wall_s, cores),
        "rollout_groups": figures["rollout_groups"],
        "groups_trained_on": figures["groups_trained_on"],
        **cpu_figures(run.cpu.totals(), wall_s, cores, verdicts.accepted),
        "warm_start_done_s": warm_start_done_s(phase, run_dir, started_at),
        "load_average_at_start": [round(x, 2) for x in load],
        "shared_model_cache": run.shared_models,
        "pool": figures["pool"],
        "stop": {**run.stop_report(), "interrupted": ended == "interrupted"},
        "log": str(run.log_path),
        "run_dir": str(run_dir),
    }
    if not lockstep:
        versions = figures["policy_versions"]
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
    base = base_run_dir or default_base()
    out = output_dir("services", base)
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
