"""The learner sweep: which GRPO settings learn most in a fixed wall time on this machine.

Every point is a real ``coevolve up`` without explorers (``--scale explorer=0``: rollout
and learner on the seed pool, so synthesis cannot favour one point), started from a copy
of one shared warm start and run for ``minutes``. Its last policy and the warm start's v1
are then scored on the same seeded sample of **train-split** turns (the tuning set): no
held-out turn chooses a default. A point's result is the paired difference last - v1 in
success, partial credit and ground-truth log-likelihood, with the run's groups and steps.

Layout of the sweep directory (resumable: a point with a ``result.json`` is skipped):

    sweep.json              the spec (minutes, tuning set)
    warm/run/               the shared warm start (as the ablation makes it)
    warm/tune-v1.json       v1's report on the tuning set
    <point>/run/            the point's run directory
    <point>/tune-last.json  its last policy's report on the tuning set
    <point>/result.json     the point's settings, run summary and paired differences
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from coevolve.code_version import code_version
from coevolve.experiment.ablation import (
    arm_dir,
    eval_report,
    merged,
    per_task,
    read_base_config,
    read_json,
    run_until_v1,
    start_up,
    write_json,
)
from coevolve.experiment.machine import machine_facts
from coevolve.report.compare import compare_reports
from coevolve.report.run_data import load_run, policy_files
from coevolve.report.run_report import summarize_run

TUNE_SPLIT = "train"
# points run their seed 0 (``<point>-s0``): the ablation's directory helpers name arms so
SEED = 0
# what a point copies from the warm start's run (besides the pool file): the learner
# resumes from the checkpoint at v1 and announces v1 on the point's fresh bus
WARM_FILES = (
    "checkpoints/learner.pt",
    "checkpoints/learner.groups.json",
    "policies/v1.safetensors",
)


@dataclass(frozen=True)
class SweepPoint:
    """One setting: ``overrides`` of the ``services.<service>`` section (the learner's
    unless named), as dotted keys (``grpo.lr``, ``max_wait_s``)."""

    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    service: str = "learner"

    def settings(self) -> dict[str, Any]:
        section: dict[str, Any] = {}
        for dotted, value in self.overrides.items():
            *parents, leaf = dotted.split(".")
            node = section
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        return {"services": {self.service: section}}


# one factor at a time around the defaults (lr 3e-4, kl_beta 0, 4 groups a step, 30 s
# wait, sampling temperature 1), in the order they were first run
POINTS: tuple[SweepPoint, ...] = (
    SweepPoint("default"),
    SweepPoint("lr-1e-4", {"grpo.lr": 1e-4}),
    SweepPoint("lr-1e-3", {"grpo.lr": 1e-3}),
    SweepPoint("groups-2", {"grpo.groups_per_step": 2}),
    SweepPoint("groups-8", {"grpo.groups_per_step": 8}),
    SweepPoint("wait-120", {"max_wait_s": 120.0}),
    SweepPoint("kl-0.01", {"grpo.kl_beta": 0.01}),
    SweepPoint("lr-5e-5", {"grpo.lr": 5e-5}),
    SweepPoint("temp-0.7", {"temperature": 0.7}, service="rollout"),
)
POINTS_BY_NAME = {point.name: point for point in POINTS}


class SweepMismatchError(ValueError):
    """The sweep directory holds a sweep with other minutes or another tuning set."""


@dataclass(frozen=True)
class SweepSpec:
    points: tuple[str, ...]
    minutes: float = 20.0
    tune_tasks: int = 80
    tune_seed: int = 0
    eval_max_steps: int = 4
    eval_threads: int = 2
    base_config: str | None = None

    def base_settings(self) -> dict[str, Any]:
        return read_base_config(self.base_config)


def point_dir(out: Path, name: str) -> Path:
    return arm_dir(out, name, SEED)


def prepare_point(out: Path, name: str) -> Path:
    """A fresh point directory whose run holds copies of the warm start's checkpoint, v1
    and pool (an interrupted point starts over)."""
    directory = point_dir(out, name)
    if directory.exists():
        shutil.rmtree(directory)
    run, warm = directory / "run", out / "warm" / "run"
    for file in (*WARM_FILES, "pool.duckdb", "pool.duckdb.wal"):
        if (warm / file).exists():
            (run / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(warm / file, run / file)
    return run


def point_result(out: Path, name: str) -> Path:
    return point_dir(out, name) / "result.json"


def pending_points(spec: SweepSpec, out: Path) -> list[str]:
    return [name for name in spec.points if not point_result(out, name).exists()]


def score_on_tuning_set(weights: Path, run: Path, report_path: Path, spec: SweepSpec) -> Any:
    """``coevolve eval`` of ``weights`` on the tuning set (its full report, per task),
    cached in ``report_path``."""
    options = ["--split", TUNE_SPLIT, "--max-steps-per-turn", str(spec.eval_max_steps)]
    options += ["--sample", str(spec.tune_tasks), "--seed", str(spec.tune_seed)]
    if spec.base_config is not None:
        options += ["--config", spec.base_config]
    return eval_report(weights, run, report_path, options, spec.eval_threads)


def headline(report: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: report.get(key)
        for key in ("n", "accuracy", "partial_credit_mean", "gt_logprob_per_token", "s_per_task")
    }


def as_report(tasks: Mapping[str, Sequence[float | None]]) -> dict[str, Any]:
    """Per-task [success, partial credit, log-likelihood] as the entries of an eval report
    (what ``compare_reports`` pairs)."""
    return {
        "entries": [
            {"entry_id": task, "score": v[0], "partial_credit": v[1], "gt_logprob": v[2]}
            for task, v in tasks.items()
        ]
    }


def versus_default(result: Mapping[str, Any], default: Mapping[str, Any] | None) -> dict[str, Any]:
    """This point's last policy minus the default point's, paired by turn ({} when either
    lacks per-turn scores, or for the default itself)."""
    if default is None or result is default:
        return {}
    mine, theirs = result["tune_last"].get("tasks"), default["tune_last"].get("tasks")
    if not mine or not theirs:
        return {}
    return compare_reports(as_report(mine), as_report(theirs))


def run_point(
    spec: SweepSpec,
    out: Path,
    point: SweepPoint,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One point, start to result file: the run, then its last policy on the tuning set."""
    directory = point_dir(out, point.name)
    run = prepare_point(out, point.name)
    config = directory / "coevolve.yaml"
    config.write_text(yaml.safe_dump(merged(spec.base_settings(), point.settings())))
    log(f"[sweep] {point.name}: {spec.minutes:g} min in {run}")
    with start_up(run, directory / "up.log", base_run_dir, config, ["explorer=0"]) as up:
        up.nats_url()
        # its minutes count from its bus being up; up exiting before them fails the point
        up.expect(up.wait(seconds=up.elapsed_s() + spec.minutes * 60.0), "time")
    last = max(policy_files(run), default=1)
    log(f"[sweep] {point.name}: scoring v{last} on the tuning set")
    weights = run / "policies" / f"v{last}.safetensors"
    last_report = score_on_tuning_set(weights, run, directory / "tune-last.json", spec)
    v1_report = read_json(out / "warm" / "tune-v1.json")
    result: dict[str, Any] = {
        "point": point.name,
        "overrides": dict(point.overrides),
        "service": point.service,
        "minutes": spec.minutes,
        "started_at": up.started_at,
        "code_version": code_version(),
        "machine": machine_facts(),
        "last_version": last,
        "tune_last": per_task(last_report),
        "tune_v1": headline(v1_report),
        "last_minus_v1": compare_reports(last_report, v1_report),
        "summary": asdict(summarize_run(load_run(run))),
    }
    write_json(point_result(out, point.name), result)
    return result


def run_sweep(
    spec: SweepSpec, out: Path, base_run_dir: Path, log: Callable[[str], None] = print
) -> list[str]:
    """The warm start and v1's score once, then every pending point; returns those run."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "sweep.json"
    if spec_file.exists():
        old = read_json(spec_file)
        for key in ("minutes", "tune_tasks", "tune_seed"):
            if old[key] != getattr(spec, key):
                raise SweepMismatchError(f"{out} holds a sweep with {key} = {old[key]}")
    write_json(spec_file, asdict(spec))
    todo = pending_points(spec, out)
    if not todo:
        log("[sweep] every point is finished")
        return []
    config = Path(spec.base_config) if spec.base_config else None
    warm = run_until_v1(out / "warm", base_run_dir, log, config)
    log("[sweep] scoring v1 on the tuning set")
    score_on_tuning_set(
        warm / "policies" / "v1.safetensors", warm, out / "warm" / "tune-v1.json", spec
    )
    for name in todo:
        run_point(spec, out, POINTS_BY_NAME[name], base_run_dir, log)
    return todo


def load_point_results(out: Path) -> list[dict[str, Any]]:
    found = [json.loads(p.read_text()) for p in sorted(out.glob("*-s*/result.json"))]
    order = {point.name: i for i, point in enumerate(POINTS)}
    return sorted(found, key=lambda r: order.get(r["point"], len(order)))


def parse_points(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in POINTS_BY_NAME]
    if unknown or not names:
        raise ValueError(f"unknown point(s) {unknown}; choose from {', '.join(POINTS_BY_NAME)}")
    return names


def _interval(result: Mapping[str, Any], key: str, digits: int = 3) -> str:
    value, ci, p = result.get(key), result.get(f"{key}_ci"), result.get(f"{key}_p")
    if value is None or ci is None:
        return "-"
    return f"{value:+.{digits}f} [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}] p={p:.3g}"


def sweep_table(results: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row a point: settings, steps, groups, last - v1 per measure, and its last
    policy against the default point's in partial credit and log-likelihood."""
    default = next((r for r in results if r["point"] == "default"), None)
    rows = []
    for result in results:
        summary, delta = result["summary"], result["last_minus_v1"]
        against = versus_default(result, default)
        prefix = "" if result.get("service", "learner") == "learner" else f"{result['service']}."
        settings = (
            ", ".join(f"{prefix}{k}={v}" for k, v in result["overrides"].items()) or "defaults"
        )
        rows.append(
            [
                result["point"],
                settings,
                str(summary["learner_steps"]),
                str(summary["groups_recorded"]),
                f"v{result['last_version']}",
                _interval(delta, "delta_success"),
                _interval(delta, "delta_partial_credit"),
                _interval(delta, "delta_gt_logprob"),
                _interval(against, "delta_partial_credit"),
                _interval(against, "delta_gt_logprob"),
            ]
        )
    return rows


SWEEP_COLUMNS = (
    "point",
    "settings",
    "learner steps",
    "groups",
    "last",
    "success, last - v1",
    "partial credit, last - v1",
    "log-lik per token, last - v1",
    "partial credit, last - default's last",
    "log-lik per token, last - default's last",
)


def render_sweep_report(out: Path) -> str:
    """The sweep's Markdown table from its result files alone (also written to
    ``OUT/report.md``)."""
    results = load_point_results(out)
    spec = read_json(out / "sweep.json") if (out / "sweep.json").exists() else {}
    lines = [
        "# Learner sweep",
        "",
        f"{len(results)} points, {spec.get('minutes', '?')} min each from one warm start, "
        f"scored on {spec.get('tune_tasks', '?')} train-split turns "
        f"(seed {spec.get('tune_seed', '?')}); differences are paired by turn (last policy - "
        "v1, and last policy - the default point's last), with 95% bootstrap intervals and "
        "paired p-values.",
        "",
        "| " + " | ".join(SWEEP_COLUMNS) + " |",
        "|" + "---|" * len(SWEEP_COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in sweep_table(results)]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text
