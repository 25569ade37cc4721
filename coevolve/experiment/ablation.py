"""The synthesis ablation: none vs random vs coevolve, each a real ``coevolve up`` run.

Layout of the experiment directory (everything resumable; a finished arm x seed has a
``result.json`` and is skipped):

    experiment.json            the spec (arms, seeds, minutes, eval settings)
    warm/run/                  one warm start: policy v1, learner checkpoint, seed pool
    warm/eval-v1.json          held-out success of v1 (minute 0 of every arm)
    <arm>-s<seed>/run/         the arm's run directory (``coevolve report`` works on it)
    <arm>-s<seed>/marks/       the policy file that was current at each minute mark
    <arm>-s<seed>/result.json  marks, held-out success at each, the run's summary

Arms: ``none`` runs without explorers (``--scale explorer=0``): GRPO on the seed pool
only. ``coevolve`` runs the defaults (signal-guided synthesis). ``random`` turns the
signal detectors off (``signal_monitor.detectors.kinds: []``) and sends seed-mode
exploration requests paced by :class:`Pacer` to add as many tasks as the coevolve arm
of the same seed did by the same minute. Every arm starts from a copy of the same warm
start (learner checkpoint, ``policies/v1``, pool file), so they differ only from there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import yaml

from coevolve.cli.explore_cmd import choose_tasks, publish_requests
from coevolve.experiment import ARMS
from coevolve.processes import (
    kill_leftovers,
    share_model_cache,
    spawn_up,
    stop_process_group,
    wait_for_nats_url,
)
from coevolve.report.run_data import load_run, policy_files
from coevolve.report.run_report import summarize_run
from coevolve.shared.messages import DecodeError, Exploration, TaskAdded, decode
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.credentials import run_bus_settings
from coevolve.shared.runtime.nats_server import free_port
from coevolve.shared.runtime.subjects import EXPLORATIONS, TASK_ADDED

# coevolve first: random is paced on its curve
RUN_ORDER = ("coevolve", "random", "none")
EVAL_SUITE = "bfcl-turns-base"
EVAL_SPLIT = "eval"
WARM_START_TIMEOUT_S = 3 * 3600.0
# what an arm copies from the warm start (besides the pool file)
WARM_FILES = (
    "checkpoints/learner.pt",
    "checkpoints/learner.groups.json",
    "policies/v1.safetensors",
)
# what says the warm start is done: v1 is announced only after its checkpoint is written
WARM_DONE_FILES = ("checkpoints/learner.pt", "policies/v1.safetensors")
TICK_S = 10.0


@dataclass(frozen=True)
class ExperimentSpec:
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    minutes: float
    eval_tasks: int = 40
    eval_every_minutes: float = 10.0
    # a coevolve.yaml every run starts from (warm start included); arms add their part
    base_config: str | None = None
    # assistant messages per held-out task: a per-turn task needs its calls and a reply
    eval_max_steps: int = 4

    def base_settings(self) -> dict[str, Any]:
        if self.base_config is None:
            return {}
        loaded = yaml.safe_load(Path(self.base_config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{self.base_config} must hold a mapping")
        return loaded

    def world(self) -> list[str] | None:
        """The API classes the runs train in (``pool_store.seed_classes``; None: all)."""
        from coevolve.services.pool_store.config import PoolStoreConfig

        section = self.base_settings().get("services", {}).get("pool_store", {})
        return msgspec.convert(section, PoolStoreConfig).seed_classes

    def marks(self) -> list[float]:
        """Minute marks at which the current policy is kept for evaluation (0 excluded:
        minute 0 is the shared warm start)."""
        count = math.floor(self.minutes / self.eval_every_minutes + 1e-9)
        marks = [round(self.eval_every_minutes * i, 3) for i in range(1, count + 1)]
        if not marks or marks[-1] < self.minutes:
            marks.append(self.minutes)
        return marks

    def plan(self) -> list[tuple[str, int]]:
        """Every arm x seed in the order they run: per seed, coevolve before random."""
        return [(arm, seed) for seed in self.seeds for arm in RUN_ORDER if arm in self.arms]


def arm_dir(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm}-s{seed}"


def result_path(out: Path, arm: str, seed: int) -> Path:
    return arm_dir(out, arm, seed) / "result.json"


def pending(spec: ExperimentSpec, out: Path) -> list[tuple[str, int]]:
    """The arm x seed pairs without a result file yet (finished ones are skipped)."""
    return [(arm, seed) for arm, seed in spec.plan() if not result_path(out, arm, seed).exists()]


def write_json(path: Path, value: Any) -> None:
    """Atomically: a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(json.dumps(value, indent=1, sort_keys=True))
    partial.replace(path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------- pacing


@dataclass
class Pacer:
    """When the random arm sends its next unguided exploration request.

    Rule: every tick, ``target`` = tasks the coevolve arm of this seed had added by
    ``minute + lead_minutes``; ``shortfall`` = target - tasks this arm has added. While
    the shortfall exceeds the requests in flight (sent, not yet answered by an
    exploration, younger than ``in_flight_minutes``) and fewer than ``max_in_flight`` are
    in flight, send one more. The lead covers the minutes from request to pool.
    """

    reference_minutes: Sequence[float]
    lead_minutes: float = 2.0
    in_flight_minutes: float = 5.0
    max_in_flight: int = 2
    added: int = 0
    sent: int = 0
    _in_flight: deque[float] = field(default_factory=deque)

    def target(self, minute: float) -> int:
        return sum(1 for m in self.reference_minutes if m <= minute + self.lead_minutes)

    def answered(self) -> None:
        if self._in_flight:
            self._in_flight.popleft()

    def requests_due(self, minute: float) -> int:
        while self._in_flight and self._in_flight[0] < minute - self.in_flight_minutes:
            self._in_flight.popleft()
        shortfall = self.target(minute) - self.added
        due = 0
        while shortfall > len(self._in_flight) and len(self._in_flight) < self.max_in_flight:
            self._in_flight.append(minute)
            due += 1
        self.sent += due
        return due


# ---------------------------------------------------------------------- processes


def start_up(
    run_dir: Path,
    nats_port: int,
    log_path: Path,
    config: Path | None = None,
    scale: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``coevolve up`` in its own process group, with an optional config and scale."""
    env = dict(os.environ)
    for inherited in ("NATS_URL", "COEVOLVE_CONFIG", "COEVOLVE_RUN_DIR"):
        env.pop(inherited, None)
    options = ["--quiet", "--run-dir", str(run_dir), "--nats-port", str(nats_port)]
    if config is not None:
        options += ["--config", str(config)]
    for value in scale:
        options += ["--scale", value]
    return spawn_up(options, env, log_path)


def stop_up(process: subprocess.Popen[bytes], run_dir: Path) -> None:
    stop_process_group(process)
    kill_leftovers(str(run_dir.resolve()))


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, mappings merged key by key."""
    result = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def arm_settings(
    arm: str, seed: int, base: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(config file contents, --scale values) of an arm, over the ``base`` settings."""
    detectors: dict[str, Any] = {"reservoir_seed": seed}
    scale: list[str] = []
    if arm == "none":
        scale.append("explorer=0")
    elif arm == "random":
        detectors["kinds"] = []
    elif arm != "coevolve":
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    own = {"services": {"signal_monitor": {"detectors": detectors}}}
    return merged(base or {}, own), scale


# ---------------------------------------------------------------------- warm start


def warm_run_dir(out: Path) -> Path:
    return out / "warm" / "run"


def warm_start(
    out: Path,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
    config: Path | None = None,
) -> Path:
    """Run ``up`` until the learner has written policy v1 and its checkpoint; once."""
    run = warm_run_dir(out)
    done = out / "warm" / "done.json"
    if done.exists():
        return run
    share_model_cache(run, base_run_dir)
    process = start_up(run, free_port(), out / "warm" / "up.log", config)
    started = time.monotonic()
    try:
        wait_for_nats_url(run, process)
        log(f"[experiment] warm start in {run}")
        while not all((run / name).exists() for name in WARM_DONE_FILES):
            if process.poll() is not None:
                raise RuntimeError(
                    f"coevolve up exited with {process.returncode} (see {out / 'warm' / 'up.log'})"
                )
            if time.monotonic() - started > WARM_START_TIMEOUT_S:
                raise TimeoutError("no policy v1 within the warm-start timeout")
            time.sleep(5)
        time.sleep(5)  # the groups file follows the checkpoint
    finally:
        stop_up(process, run)
    write_json(done, {"seconds": round(time.monotonic() - started, 1)})
    log(f"[experiment] warm start done in {time.monotonic() - started:.0f} s")
    return run


def prepare_arm(out: Path, arm: str, seed: int, base_run_dir: Path) -> Path:
    """A fresh arm directory whose run holds copies of the warm start's checkpoint, v1
    and pool. An arm interrupted before its result file starts over: its run, kept
    policies and cached scores are removed (a new run's v3 is not the old run's v3)."""
    directory = arm_dir(out, arm, seed)
    if directory.exists():
        shutil.rmtree(directory)
    run = directory / "run"
    warm = warm_run_dir(out)
    for name in (*WARM_FILES, "pool.duckdb", "pool.duckdb.wal"):
        if (warm / name).exists():
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(warm / name, run / name)
    share_model_cache(run, base_run_dir)
    return run


# ---------------------------------------------------------------------- one arm


@dataclass
class ArmLive:
    """What the controller saw during an arm: policy at each mark, tasks added."""

    mark_versions: dict[float, int] = field(default_factory=dict)
    added_minutes: list[float] = field(default_factory=list)
    requests_sent: int = 0


async def control_arm(
    url: str,
    run: Path,
    marks_dir: Path,
    spec: ExperimentSpec,
    started: float,
    pacer: Pacer | None,
    seed: int,
) -> ArmLive:
    """Until ``spec.minutes``: keep the policy file current at each mark, count tasks
    added, and (random arm) send the paced exploration requests."""
    live = ArmLive()
    world = spec.world()  # read once: the pacer's loop sends requests every few seconds
    bus = await Bus.connect(run_bus_settings(run, url), name="experiment")
    rng = random.Random(seed)
    try:
        await bus.ensure_streams()
        added = await bus.nc.subscribe(TASK_ADDED)
        explorations = await bus.nc.subscribe(EXPLORATIONS)

        def minute() -> float:
            return (time.monotonic() - started) / 60.0

        async def count_added() -> None:
            async for message in added.messages:
                with contextlib.suppress(DecodeError):
                    if decode(message.data, TaskAdded).origin != "seed":
                        live.added_minutes.append(round(minute(), 3))
                        if pacer is not None:
                            pacer.added += 1

        async def count_explorations() -> None:
            async for message in explorations.messages:
                with contextlib.suppress(DecodeError):
                    if decode(message.data, Exploration).mode == "unguided" and pacer:
                        pacer.answered()

        async with anyio.create_task_group() as tg:
            tg.start_soon(count_added)
            tg.start_soon(count_explorations)
            marks = list(spec.marks())
            while marks:
                now = minute()
                while marks and now >= marks[0]:
                    live.mark_versions[marks[0]] = keep_current_policy(run, marks_dir, marks[0])
                    marks.pop(0)
                if pacer is not None and marks:
                    due = pacer.requests_due(now)
                    if due:
                        draw = rng.randrange(1 << 30)
                        tasks = choose_tasks(due, seed=draw, classes=world)
                        await publish_requests(bus, tasks, rounds=1)
                        live.requests_sent += due
                if marks:
                    await anyio.sleep(min(TICK_S, max(0.5, (marks[0] - minute()) * 60)))
            tg.cancel_scope.cancel()
    finally:
        with anyio.move_on_after(5, shield=True):
            await bus.close(timeout=3.0)
    return live


def keep_current_policy(run: Path, marks_dir: Path, mark: float) -> int:
    """Copy the newest ``policies/v<N>`` to ``marks_dir`` and return N (0: none yet)."""
    files = policy_files(run)
    if not files:
        return 0
    version = max(files)
    marks_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(
        run / "policies" / f"v{version}.safetensors", marks_dir / f"v{version}.safetensors"
    )
    return version


def evaluate(
    weights: Path,
    run: Path,
    tasks: int,
    cache: Path,
    max_steps: int = 4,
    classes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Held-out per-turn BFCL success of ``weights`` (``coevolve eval`` in a subprocess),
    cached in ``cache``."""
    if cache.exists():
        return dict(read_json(cache))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "coevolve", "eval", "--suite", EVAL_SUITE, "--split", EVAL_SPLIT]
    # the same seeded sample, spread over entries, for every policy: paired across arms
    argv += ["--policy", str(weights), "--sample", str(tasks), "--seed", "0"]
    argv += ["--max-steps-per-turn", str(max_steps)]
    argv += ["--classes", ",".join(classes) if classes is not None else "all"]
    argv += ["--json", "--run-dir", str(run)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"coevolve eval failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    kept = {
        key: report[key]
        for key in ("suite", "split", "n", "accuracy", "ci95_low", "ci95_high", "total_seconds")
    }
    kept["partial_credit_mean"] = report.get("partial_credit_mean")
    kept["gt_logprob_per_token"] = report.get("gt_logprob_per_token")
    kept["scores"] = {e["entry_id"]: e["score"] for e in report.get("entries", [])}
    write_json(cache, kept)
    return kept


CODE_DIRS = ("coevolve", "services", "shared", "bench")


def code_version(commit: str = "HEAD") -> str | None:
    """The code an arm ran: git's tree ids of the package directories at ``commit``
    (shortened, ``+dirty`` when they have uncommitted changes), so a report can tell arms
    that ran on different code apart, and a commit that changes only docs changes nothing
    (an experiment may be resumed days later). None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        trees = [git("rev-parse", f"{commit}:{name}") for name in CODE_DIRS]
        dirty = commit == "HEAD" and bool(
            git("status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS)
        )
    except (OSError, subprocess.SubprocessError):
        return None
    version = hashlib.sha256(" ".join(trees).encode()).hexdigest()[:12]
    return f"{version}+dirty" if dirty else version


def run_arm(
    spec: ExperimentSpec,
    out: Path,
    arm: str,
    seed: int,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One arm x seed, start to result file."""
    directory = arm_dir(out, arm, seed)
    run = prepare_arm(out, arm, seed, base_run_dir)
    settings, scale = arm_settings(arm, seed, spec.base_settings())
    config = directory / "coevolve.yaml"
    config.write_text(yaml.safe_dump(settings))
    pacer = None
    if arm == "random":
        reference = result_path(out, "coevolve", seed)
        curve = read_json(reference)["added_minutes"] if reference.exists() else []
        pacer = Pacer(curve)
    log(f"[experiment] {arm} seed {seed}: {spec.minutes:g} min in {run}")
    process = start_up(run, free_port(), directory / "up.log", config, scale)
    started = time.monotonic()
    wall_started = time.time()
    try:
        url = wait_for_nats_url(run, process)
        live = anyio.run(control_arm, url, run, directory / "marks", spec, started, pacer, seed)
    finally:
        stop_up(process, run)
    result: dict[str, Any] = {
        "arm": arm,
        "seed": seed,
        "minutes": spec.minutes,
        "code_version": code_version(),
        "started_at": wall_started,
        "requests_sent": live.requests_sent,
        "added_minutes": live.added_minutes,
        "marks": [],
    }
    for mark, version in sorted(live.mark_versions.items()):
        weights = directory / "marks" / f"v{version}.safetensors"
        score, error = None, None
        if version > 0:
            log(f"[experiment] {arm} seed {seed}: evaluating v{version} (minute {mark:g})")
            cache = directory / "eval" / f"v{version}.json"
            if version == 1:  # the warm start's own v1, copied into every arm
                cache = out / "warm" / "eval-v1.json"
            try:
                score = evaluate(
                    weights, run, spec.eval_tasks, cache, spec.eval_max_steps, spec.world()
                )
            except (RuntimeError, ValueError, KeyError) as exc:  # recorded, not fatal
                error = str(exc)
                log(f"[experiment] {arm} seed {seed}: evaluation of v{version} failed: {exc}")
        mark_record: dict[str, Any] = {"minute": mark, "policy_version": version, "eval": score}
        if error is not None:
            mark_record["eval_error"] = error
        result["marks"].append(mark_record)
    result["summary"] = asdict(summarize_run(load_run(run)))
    write_json(result_path(out, arm, seed), result)
    return result


def run_experiment(
    spec: ExperimentSpec,
    out: Path,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
) -> list[tuple[str, int]]:
    """Warm start once, evaluate v1 once, then every pending arm x seed; returns those run."""
    # absolute: the run directory in every command line is what finds leftover processes
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "experiment.json"
    if spec_file.exists() and read_json(spec_file)["minutes"] != spec.minutes:
        raise ValueError(f"{out} holds an experiment of {read_json(spec_file)['minutes']} min")
    write_json(spec_file, asdict(spec))
    todo = pending(spec, out)
    if not todo:
        log("[experiment] every arm x seed is finished")
        return []
    config = Path(spec.base_config) if spec.base_config else None
    warm = warm_start(out, base_run_dir, log, config)
    evaluate(
        warm / "policies" / "v1.safetensors",
        warm,
        spec.eval_tasks,
        out / "warm" / "eval-v1.json",
        spec.eval_max_steps,
        spec.world(),
    )
    for arm, seed in todo:
        run_arm(spec, out, arm, seed, base_run_dir, log)
    return todo
