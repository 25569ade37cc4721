"""The synthesis ablation: none vs random vs coevolve, each a real ``coevolve up`` run.

Two directories. ``out`` holds what a machine needs while it runs (run directories,
the policies kept at marks; never committed). ``results`` holds everything the report
and a later resume on another machine need, small enough to commit:

    experiment.json           the spec (arms, seeds, minutes or steps, eval settings)
    warm-start.safetensors    the shared warm-started policy v1 (both adapters)
    warm-start.json           its sha256, the code version and machine that made it
    eval-v1.json              v1's held-out scores, per task
    <arm>-s<seed>.json        one arm x seed: marks with per-task held-out scores,
                              rollout groups, learner steps, CPU seconds per service

Arms: ``none`` runs without explorers (``--scale explorer=0``): GRPO on the seed pool
only. ``coevolve`` runs the defaults (signal-guided synthesis). ``random`` turns the
signal detectors off (``signal_monitor.detectors.kinds: []``) and sends exploration
requests that vary pool tasks drawn at random with the same synthesis machinery
(``ExplorationRequest.vary``: variants and composed turns, the same validation, fresh
first in the job feed), paced by :class:`Pacer` to add as many tasks as the coevolve arm
of the same seed did by the same minute. ``navigate``, ``attribute`` and ``both`` are
``coevolve`` with self-navigating (``distiller.enabled``), step credit
(``rollout.step_credit.enabled``) or both turned on (docs/navigation.md,
docs/learning.md). ``labelled_control`` (the no-label setting only) is ``none`` plus
BFCL's labelled train turns of the run's world, added to the pool in a seeded order at
the pacing contract's rate (``pacing.tasks_per_step`` per learner step, counted from the
learner's published policies) and fed first as fresh synthesized tasks are
(``Lineage.labelled_control``): what the best data could do at this budget. Every arm's
learner adopts the committed warm
start (``services.learner.warm_start.from_policy``, digest checked), so arms differ only
from there, wherever they run. An arm ends after ``minutes``, or once its learner has
taken ``steps`` steps (equal compute for the learner), whichever comes first; with
``steps``, an arm that the minutes ended first is kept but not pooled (aggregate.py).

The setting is the base configuration's: ``labels: none`` (with ``d0.file``) trains
every arm on discovered tasks alone, and the random arm then varies D0's tasks, never a
labelled turn. Each result records its
``setting`` (``no_labels`` or ``labelled``), ``arm``, ``seed``, ``ended_by``, ``steps``,
``scored_version`` (the policy its end mark scored: the run's last), ``commit``, ``cpu``,
``dtype`` and ``warm_start_sha256``; ``eval-v1.json`` the same of the warm start.
"""

from __future__ import annotations

import contextlib
import functools
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import yaml
from nats.errors import Error as NatsError

from coevolve.code_version import code_version
from coevolve.experiment import ARMS, NAVIGATION_ARMS
from coevolve.experiment.machine import provenance
from coevolve.exploration import publish_requests
from coevolve.harness import EXTERNAL_ENDPOINTS, UpRun, files_exist
from coevolve.processes import CpuLedger
from coevolve.report.exposure import exposure, status_record
from coevolve.report.run_data import load_run, policy_files
from coevolve.report.run_report import summarize_run
from coevolve.services.learner.warm_start import demonstration_origin
from coevolve.shared.messages import DecodeError, Exploration, Task, TaskAdded, decode
from coevolve.shared.pacing import PacingSettings
from coevolve.shared.pool_client import PoolClient, PoolError
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.credentials import run_bus_settings
from coevolve.shared.runtime.subjects import EXPLORATIONS, TASK_ADDED

if TYPE_CHECKING:
    from coevolve.services.pool_store.config import PoolStoreConfig

# coevolve first: random is paced on its curve
RUN_ORDER = (
    "coevolve",
    "random",
    "none",
    "labelled_control",
    "navigate",
    "attribute",
    "both",
    "eto",
    "coevolving_dpo",
    "navigate_off",
    "navigate_on",
)
# what each mechanism or objective arm changes in the defaults
MECHANISM_SETTINGS: dict[str, dict[str, Any]] = {
    "navigate": {"distiller": {"enabled": True}},
    "attribute": {"rollout": {"step_credit": {"enabled": True}}},
    "both": {"distiller": {"enabled": True}, "rollout": {"step_credit": {"enabled": True}}},
    "eto": {"learner": {"grpo": {"objective": "eto"}}},
    "navigate_off": {"distiller": {"enabled": False}},
    "navigate_on": {"distiller": {"enabled": True}},
    "coevolving_dpo": {
        "learner": {"grpo": {"objective": "coevolving_dpo", "preference": {"failure_agent": True}}},
        "pool_store": {"failure_agent_share": 0.25},
    },
}
EVAL_SUITE = "bfcl-turns-base"
EVAL_SPLIT = "eval"
WARM_START_TIMEOUT_S = 3 * 3600.0
WARM_POLL_S = 5.0
# the groups file follows the checkpoint: how long the warm start runs on once v1 is there
GROUPS_AFTER_CHECKPOINT_S = 5.0
# what says the warm start is done: v1 is announced only after its checkpoint is written
WARM_DONE_FILES = ("checkpoints/learner.pt", "policies/v1.safetensors")
WARM_START_FILE = "warm-start.safetensors"
WARM_START_RECORD = "warm-start.json"
WARM_EVAL_FILE = "eval-v1.json"
# in an arm's directory once its run is over: what the run saw, its evaluation pending
RUN_RECORD = "run-record.json"
# the key of an arm's last mark: where it ended (its minutes, or its learner steps)
END_MARK = "end"
TICK_S = 10.0
LABELLED_CONTROL_REFUSED = (
    "the labelled_control arm belongs to the no-label setting (labels: none with a d0.file "
    "in the base configuration, --config): it adds labelled turns to a pool that has none. "
    "In the labelled setting every arm's pool already starts with them"
)
# what eval-v1.json and an arm's marks keep of an evaluation report (besides per-task
# scores): eval-v1.json adds the provenance of the warm start beside them
EVAL_FIELDS = (
    "suite",
    "split",
    "n",
    "accuracy",
    "partial_credit_mean",
    "gt_logprob_per_token",
    "s_per_task",
    "total_seconds",
)
# how often a running arm prints where it is
PROGRESS_EVERY_MINUTES = 5.0


def base_config_file(spec: ExperimentSpec, out: Path) -> Path | None:
    """The base configuration as the warm start's ``up`` reads it: ``OUT/base.yaml``,
    written from :meth:`ExperimentSpec.base_settings` (its ``d0.file`` made absolute);
    None without one."""
    if spec.base_config is None:
        return None
    path = out / "base.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec.base_settings(), sort_keys=False))
    return path


def read_base_config(path: str | None) -> dict[str, Any]:
    """The YAML configuration every run of an experiment starts from ({} for none). A
    relative ``d0.file`` is made absolute from the current directory: each arm's run
    directory would otherwise be its base."""
    if path is None:
        return {}
    loaded = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a mapping")
    d0 = loaded.get("d0")
    if isinstance(d0, dict) and isinstance(d0.get("file"), str):
        d0["file"] = str(Path(d0["file"]).expanduser().resolve())
    return loaded


class ResultsMismatchError(ValueError):
    """The results directory holds another experiment, or a damaged warm start."""


@dataclass(frozen=True)
class ExperimentSpec:
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    minutes: float
    # held-out turns per evaluation (a seeded sample); None: every eval-split turn of the
    # world (108 in the default world)
    eval_tasks: int | None = None
    eval_every_minutes: float = 10.0
    # a coevolve.yaml every run starts from (warm start included); arms add their part
    base_config: str | None = None
    # assistant messages per held-out task: a per-turn task needs its calls and a reply
    eval_max_steps: int = 4
    # end an arm once its learner has taken this many steps (minutes stay the cap)
    steps: int | None = None

    def base_settings(self) -> dict[str, Any]:
        return read_base_config(self.base_config)

    def setting(self) -> str:
        """``no_labels`` when the runs train on discovered tasks alone (``labels: none``
        in the base configuration), else ``labelled``."""
        return "no_labels" if self.base_settings().get("labels") == "none" else "labelled"

    def world(self) -> list[str] | None:
        """The API classes the runs train in (``pool_store.seed_classes``; None: all)."""
        return self.pool_store().seed_classes

    def pool_store(self) -> PoolStoreConfig:
        """The runs' ``services.pool_store`` section."""
        from coevolve.services.pool_store.config import PoolStoreConfig

        section = self.base_settings().get("services", {}).get("pool_store", {})
        return msgspec.convert(section, PoolStoreConfig)

    def pacing(self) -> PacingSettings:
        """The runs' pacing contract (the ``pacing`` section)."""
        return msgspec.convert(self.base_settings().get("pacing", {}), PacingSettings)

    def check(self) -> None:
        """ValueError when an arm does not belong to the setting."""
        if "labelled_control" in self.arms and self.setting() != "no_labels":
            raise ValueError(LABELLED_CONTROL_REFUSED)

    def marks(self) -> list[float]:
        """Minute marks before the end at which the current policy is kept for
        evaluation (minute 0 is the shared warm start; the end is a mark of its own)."""
        count = math.floor(self.minutes / self.eval_every_minutes + 1e-9)
        return [
            round(self.eval_every_minutes * i, 3)
            for i in range(1, count + 1)
            if self.eval_every_minutes * i < self.minutes - 1e-9
        ]

    def plan(self) -> list[tuple[str, int]]:
        """Every arm x seed in the order they run: per seed, coevolve before random."""
        return [(arm, seed) for seed in self.seeds for arm in RUN_ORDER if arm in self.arms]


def arm_dir(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm}-s{seed}"


def result_path(results: Path, arm: str, seed: int) -> Path:
    return results / f"{arm}-s{seed}.json"


def pending(
    spec: ExperimentSpec, results: Path, max_runs: int | None = None
) -> list[tuple[str, int]]:
    """The arm x seed pairs without a result file yet (finished ones are skipped), in the
    plan's order; the first ``max_runs`` of them when given."""
    todo = [
        (arm, seed) for arm, seed in spec.plan() if not result_path(results, arm, seed).exists()
    ]
    return todo[:max_runs]


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

    def not_sent(self, count: int) -> None:
        """Take back the last ``count`` requests :meth:`requests_due` gave: they could not
        be sent, so they are due again at the next tick."""
        for _ in range(min(count, len(self._in_flight))):
            self._in_flight.pop()
        self.sent -= count


@dataclass
class LabelledFeed:
    """What the labelled_control arm adds next: its labelled turns in their seeded order,
    as many as the pacing contract owes once the learner has taken ``steps_done`` steps
    (``PacingSettings.owed``: what a coevolve arm's data loop must have delivered by
    then: ``pacing.tasks_per_step`` a step once ``pacing.grace_steps`` are done)."""

    tasks: Sequence[Task]
    pacing: PacingSettings
    # turns sent to pool-store so far, and of them those now in the pool
    sent: int = 0
    delivered: int = 0

    def due(self, steps_done: int) -> list[Task]:
        """The next turns to add, each stamped with the minute it joins."""
        missing = self.pacing.owed(steps_done) - self.delivered
        chosen = self.tasks[self.sent : self.sent + max(0, missing)]
        return [msgspec.structs.replace(task, created_at=time.time()) for task in chosen]

    def answered(self, sent: int, in_pool: int) -> None:
        self.sent += sent
        self.delivered += in_pool


def labelled_control_tasks(spec: ExperimentSpec, seed: int) -> list[Task]:
    """The labelled train turns of the runs' world that a pool seeds with ``labels: bfcl``
    (``seed_tasks_for`` with the base configuration's pool-store section: per-turn tasks by
    default), in an order the seed fixes, each marked ``lineage.labelled_control``."""
    from coevolve.services.pool_store.handler import seed_tasks_for

    config = spec.pool_store()
    tasks = [
        task
        for environment in config.seed_environments
        for task in seed_tasks_for(environment, config.seed_grains, config.seed_classes)
    ]
    random.Random(seed).shuffle(tasks)
    return [
        msgspec.structs.replace(
            task, lineage=msgspec.structs.replace(task.lineage, labelled_control=True)
        )
        for task in tasks
    ]


# ---------------------------------------------------------------------- processes


def start_up(
    run_dir: Path,
    log_path: Path,
    base_run_dir: Path,
    config: Path | None = None,
    scale: Sequence[str] = (),
) -> UpRun:
    """``coevolve up`` on ``run_dir`` as every run of an experiment starts (the harness's
    :meth:`~coevolve.harness.UpRun.start`): quiet, on a NATS server of its own, with the
    caller's LLM endpoint and credentials, the base run's converted models linked in."""
    return UpRun.start(
        run_dir,
        log_path,
        config=config,
        scale=scale,
        quiet=True,
        keep_env=EXTERNAL_ENDPOINTS,
        base=base_run_dir,
    )


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, mappings merged key by key."""
    result = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


@dataclass(frozen=True)
class WarmStart:
    """The committed warm-started policy every arm adopts."""

    path: Path
    sha256: str

    def learner_settings(self) -> dict[str, Any]:
        return {
            "services": {
                "learner": {
                    "warm_start": {
                        "from_policy": str(self.path.resolve()),
                        "from_policy_sha256": self.sha256,
                    }
                }
            }
        }


def arm_settings(
    arm: str, seed: int, base: dict[str, Any] | None = None, warm: WarmStart | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(config file contents, --scale values) of an arm, over the ``base`` settings."""
    detectors: dict[str, Any] = {"reservoir_seed": seed}
    scale: list[str] = []
    if arm == "labelled_control" and (base or {}).get("labels") != "none":
        raise ValueError(LABELLED_CONTROL_REFUSED)
    if arm in ("none", "labelled_control", *NAVIGATION_ARMS):
        scale.append("explorer=0")  # the control's turns come from the controller
    elif arm == "random":
        detectors["kinds"] = []
    elif arm != "coevolve" and arm not in MECHANISM_SETTINGS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    own: dict[str, Any] = {"services": {"signal_monitor": {"detectors": detectors}}}
    own = merged(own, {"services": MECHANISM_SETTINGS.get(arm, {})})
    if warm is not None:
        own = merged(own, warm.learner_settings())
    return merged(base or {}, own), scale


# ---------------------------------------------------------------------- warm start


def run_until_v1(
    directory: Path,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
    config: Path | None = None,
) -> Path:
    """Run ``up`` in ``directory/run`` until the learner has written policy v1 and its
    checkpoint, once (``directory/done.json`` says it is done); returns the run."""
    run = directory / "run"
    done = directory / "done.json"
    if done.exists():
        return run
    with start_up(run, directory / "up.log", base_run_dir, config) as up:
        up.nats_url()
        log(f"[experiment] warm start in {run}")
        v1_written = files_exist(*WARM_DONE_FILES)
        ended = up.wait(v1_written, seconds=WARM_START_TIMEOUT_S, poll_s=WARM_POLL_S)
        up.expect(ended, "condition", "policy v1")
        time.sleep(GROUPS_AFTER_CHECKPOINT_S)
    seconds = time.monotonic() - up.started
    write_json(done, {"seconds": round(seconds, 1)})
    log(f"[experiment] warm start done in {seconds:.0f} s")
    return run


def committed_warm_start(results: Path) -> WarmStart | None:
    """The warm start kept in ``results``, its file checked against its recorded digest."""
    record, path = results / WARM_START_RECORD, results / WARM_START_FILE
    if not record.exists():
        return None
    sha256 = str(read_json(record)["sha256"])
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise ResultsMismatchError(f"{path} is missing or does not match the sha256 in {record}")
    return WarmStart(path, sha256)


def ensure_warm_start(
    out: Path,
    results: Path,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
    config: Path | None = None,
) -> WarmStart:
    """The committed warm start, or a new one: ``up`` until v1, whose file is kept in
    ``results`` with its sha256, the code version and the machine."""
    kept = committed_warm_start(results)
    if kept is not None:
        log(f"[experiment] warm start {kept.sha256[:12]} from {kept.path}")
        return kept
    started = time.monotonic()
    run = run_until_v1(out / "warm", base_run_dir, log, config)
    blob = (run / "policies" / "v1.safetensors").read_bytes()
    results.mkdir(parents=True, exist_ok=True)
    (results / WARM_START_FILE).write_bytes(blob)
    sha256 = hashlib.sha256(blob).hexdigest()
    record = {
        "sha256": sha256,
        "bytes": len(blob),
        "code_version": code_version(),
        **provenance(),
        "made_at": time.time(),
        "seconds": round(time.monotonic() - started, 1),
    }
    write_json(results / WARM_START_RECORD, record)
    return WarmStart(results / WARM_START_FILE, sha256)


def prepare_arm(out: Path, arm: str, seed: int) -> Path:
    """A fresh arm directory. An arm interrupted before its run was over starts over: its
    run, kept policies and cached scores are removed (a new run's v3 is not the old
    run's v3)."""
    directory = arm_dir(out, arm, seed)
    if directory.exists():
        shutil.rmtree(directory)
    run = directory / "run"
    run.mkdir(parents=True)
    return run


# ---------------------------------------------------------------------- one arm


@dataclass
class ArmLive:
    """What the controller saw during an arm: policy at each mark, tasks added, CPU."""

    mark_versions: dict[float, int] = field(default_factory=dict)
    added_minutes: list[float] = field(default_factory=list)
    requests_sent: int = 0
    labelled_sent: int = 0
    end_minute: float = 0.0
    end_version: int = 0
    ended_by: str = "minutes"
    cpu: CpuLedger = field(default_factory=CpuLedger)


def progress_line(minute: float, spec: ExperimentSpec, version: int, live: ArmLive) -> str:
    """Where a running arm is: its minute, policy, tasks added and CPU so far."""
    cpu_minutes = sum(live.cpu.totals().values()) / 60.0
    steps = str(max(version - 1, 0))  # policy v(N+1) comes from the N-th step
    if spec.steps is not None:
        steps += f" of {spec.steps}"
    line = (
        f"minute {minute:.1f} of {spec.minutes:g}: policy v{version} after {steps} learner "
        f"steps, {len(live.added_minutes)} tasks added"
    )
    if live.requests_sent:
        line += f" ({live.requests_sent} exploration requests sent)"
    return line + f", {cpu_minutes:.1f} CPU minutes"


async def control_arm(
    url: str,
    run: Path,
    marks_dir: Path,
    spec: ExperimentSpec,
    started: float,
    pacer: Pacer | None,
    seed: int,
    up: UpRun | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every_minutes: float = PROGRESS_EVERY_MINUTES,
    labelled_feed: LabelledFeed | None = None,
    tick_s: float = TICK_S,
) -> ArmLive:
    """Until ``spec.minutes`` (or ``spec.steps`` learner steps): keep the policy file
    current at each mark and at the end, count tasks added, sample the CPU time of the
    run's processes (``up``'s, into its ledger), (random arm) send the paced exploration
    requests, (labelled_control arm) add the labelled turns the learner's steps so far are
    owed, and every ``progress_every_minutes`` tell ``progress`` where the arm is."""
    live = ArmLive() if up is None else ArmLive(cpu=up.cpu)
    labelled = spec.setting() == "labelled"  # no labels: vary D0's tasks
    say = progress if progress is not None else print
    bus = await Bus.connect(run_bus_settings(run, url), name="experiment")
    rng = random.Random(seed)
    # policy v(N+1) is the one the learner publishes after its N-th step
    last_version = None if spec.steps is None else spec.steps + 1
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

        def steps_done() -> bool:
            files = policy_files(run)
            return last_version is not None and max(files, default=0) >= last_version

        async with anyio.create_task_group() as tg:
            tg.start_soon(count_added)
            tg.start_soon(count_explorations)
            marks = list(spec.marks())
            next_progress = progress_every_minutes
            while True:
                now = minute()
                if up is not None:
                    up.sample_cpu()
                if progress is not None and now >= next_progress:
                    progress(progress_line(now, spec, max(policy_files(run), default=0), live))
                    next_progress = now + progress_every_minutes
                while marks and now >= marks[0]:
                    live.mark_versions[marks[0]] = keep_current_policy(run, marks_dir)
                    marks.pop(0)
                if steps_done() or now >= spec.minutes:
                    live.ended_by = "steps" if steps_done() else "minutes"
                    live.end_minute = round(now, 3)
                    live.end_version = keep_current_policy(run, marks_dir, last_version)
                    break
                if pacer is not None:
                    due = pacer.requests_due(now)
                    if due:
                        seed_now = rng.randrange(1 << 30)
                        live.requests_sent += await send_unguided(
                            bus, pacer, due, seed_now, labelled, say
                        )
                if labelled_feed is not None:
                    joined = await add_labelled_turns(bus, labelled_feed, run, live, say)
                    live.added_minutes += [round(now, 3)] * joined
                next_mark = min([*marks[:1], spec.minutes])
                await anyio.sleep(min(tick_s, max(0.5, (next_mark - minute()) * 60)))
            tg.cancel_scope.cancel()
    finally:
        with anyio.move_on_after(5, shield=True):
            await bus.close(timeout=3.0)
    return live


async def send_unguided(
    bus: Bus, pacer: Pacer, due: int, seed: int, labelled: bool, log: Callable[[str], None]
) -> int:
    """The random arm's ``due`` exploration requests, each varying a pool task drawn at
    random; returns how many were sent. While pool-store does not answer (the run is
    still starting, or it restarts) none is, and they stay due for the next tick."""
    try:
        tasks = await unguided_parents(bus, due, seed, labelled)
    except (TimeoutError, PoolError, NatsError) as exc:
        pacer.not_sent(due)
        log(f"unguided requests not sent, tried again at the next tick: {exc!r}")
        return 0
    await publish_requests(bus, tasks, rounds=1, vary=True)
    return len(tasks)


async def unguided_parents(bus: Bus, count: int, seed: int, labelled: bool) -> list[Task]:
    """``count`` tasks with ground truth drawn from the run's pool at random (the labelled
    turns, or with no labels D0's tasks): what the random arm varies with the synthesis
    machinery the coevolve arm aims at failures."""
    origin = demonstration_origin("bfcl" if labelled else "none")
    with anyio.fail_after(30):
        drawn = await PoolClient(bus).sample(count, mix={origin: 1.0}, seed=seed)
    return [task for task in drawn if task.ground_truth][:count]


async def add_labelled_turns(
    bus: Bus, feed: LabelledFeed, run: Path, live: ArmLive, log: Callable[[str], None]
) -> int:
    """Send pool-store the labelled turns owed for the learner's steps so far (policy
    v(N+1) is published after N steps); returns how many joined the pool. A turn
    pool-store already holds (an add whose reply was lost) counts as joined; one not
    answered is sent again at the next tick."""
    steps_done = max(max(policy_files(run), default=1) - 1, 0)
    tasks = feed.due(steps_done)
    if not tasks:
        return 0
    try:
        with anyio.fail_after(30):
            reply = await PoolClient(bus).add_tasks(tasks)
    except (TimeoutError, PoolError, NatsError) as exc:
        log(f"labelled turns not added, sent again at the next tick: {exc!r}")
        return 0
    joined = len(reply.added) + len(reply.duplicates)
    feed.answered(len(tasks), joined)
    live.labelled_sent += len(tasks)
    return joined


def keep_current_policy(run: Path, marks_dir: Path, at_most: int | None = None) -> int:
    """Copy the newest ``policies/v<N>`` (N at most ``at_most``) to ``marks_dir`` and
    return N (0: none yet)."""
    files = [v for v in policy_files(run) if at_most is None or v <= at_most]
    if not files:
        return 0
    version = max(files)
    marks_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(
        run / "policies" / f"v{version}.safetensors", marks_dir / f"v{version}.safetensors"
    )
    return version


def per_task(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the results keep of an eval report: the headline and, per task, [success,
    partial credit, ground-truth log-likelihood per token]."""
    kept = {key: report.get(key) for key in EVAL_FIELDS}
    kept["tasks"] = {
        str(e["entry_id"]): [e.get("score"), e.get("partial_credit"), e.get("gt_logprob")]
        for e in report.get("entries", [])
    }
    return kept


def eval_report(
    weights: Path, run: Path, report_path: Path, options: Sequence[str], threads: int
) -> Any:
    """``coevolve eval --suite bfcl-turns-base OPTIONS`` of ``weights`` in a subprocess on
    ``threads`` threads, its full report cached in ``report_path``."""
    if not report_path.exists():
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        for inherited in ("COEVOLVE_CONFIG", "COEVOLVE_RUN_DIR"):
            env.pop(inherited, None)
        argv = [sys.executable, "-m", "coevolve", "eval", "--suite", EVAL_SUITE, *options]
        argv += ["--policy", str(weights), "--out", str(report_path), "--run-dir", str(run)]
        report_path.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0 or not report_path.exists():
            raise RuntimeError(f"coevolve eval failed ({done.returncode}): {done.stderr[-2000:]}")
    return read_json(report_path)


def evaluate(
    weights: Path,
    run: Path,
    tasks: int | None,
    cache: Path,
    max_steps: int = 4,
    classes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Held-out per-turn BFCL scores of ``weights`` (on every core: nothing else runs
    then), per task; the full report is kept in ``cache``."""
    options = ["--split", EVAL_SPLIT, "--max-steps-per-turn", str(max_steps)]
    if tasks is not None:  # the same seeded sample for every policy: paired across arms
        options += ["--sample", str(tasks), "--seed", "0"]
    options += ["--classes", ",".join(classes) if classes is not None else "all"]
    return per_task(eval_report(weights, run, cache, options, os.cpu_count() or 1))


@dataclass(frozen=True)
class ArmRun:
    """One arm x seed of an experiment, and where it runs and reports."""

    spec: ExperimentSpec
    out: Path
    results: Path
    arm: str
    seed: int
    warm: WarmStart
    base_run_dir: Path
    log: Callable[[str], None] = print

    @property
    def directory(self) -> Path:
        return arm_dir(self.out, self.arm, self.seed)

    def say(self, text: str) -> None:
        self.log(f"[experiment] {self.arm} seed {self.seed}: {text}")


def run_arm(job: ArmRun) -> dict[str, Any]:
    """One arm x seed, start to result file. Once its run is over, what the run saw is
    kept in the arm's directory (``RUN_RECORD``), so an arm stopped during its held-out
    evaluation resumes there instead of running again."""
    spec, directory = job.spec, job.directory
    record_path = directory / RUN_RECORD
    if record_path.exists():
        job.say("its run is over; evaluating its policies")
        record = read_json(record_path)
    else:
        record = run_arm_until_end(job)
        write_json(record_path, record)
    result = {key: value for key, value in record.items() if key != "mark_versions"}
    result["marks"] = []
    for key, minute, version in record["mark_versions"]:
        score, error = None, None
        if version == 1:  # the adopted warm start, scored once for every arm
            warm_eval = read_json(job.results / WARM_EVAL_FILE)
            score = {k: warm_eval[k] for k in (*EVAL_FIELDS, "tasks") if k in warm_eval}
        elif version > 0:
            job.say(f"evaluating v{version} ({key})")
            weights = directory / "marks" / f"v{version}.safetensors"
            cache = directory / "eval" / f"v{version}.json"
            try:
                score = evaluate(
                    weights,
                    directory / "run",
                    spec.eval_tasks,
                    cache,
                    spec.eval_max_steps,
                    spec.world(),
                )
            except (RuntimeError, ValueError, KeyError) as exc:  # recorded, not fatal
                error = str(exc)
                job.say(f"evaluation of v{version} failed: {exc}")
        mark: dict[str, Any] = {
            "mark": key,
            "minute": minute,
            "policy_version": version,
            "eval": score,
        }
        if error is not None:
            mark["eval_error"] = error
        result["marks"].append(mark)
    # the end mark is the run's last policy (run_arm_until_end)
    result["scored_version"] = record["mark_versions"][-1][2]
    data = load_run(directory / "run")
    result["summary"] = asdict(summarize_run(data))
    result["exposure"] = status_record(exposure(data), data.pool_error)
    write_json(result_path(job.results, job.arm, job.seed), result)
    return result


def settle_end(live: ArmLive, run: Path, marks_dir: Path, steps: int | None) -> None:
    """Make the end mark the run's last policy: one the learner published between the
    controller's last look and the run's stop is kept and scored instead (with ``steps``,
    the last within them: v(steps+1)), and a run that reached its steps that way ended by
    them."""
    last_version = None if steps is None else steps + 1
    final = keep_current_policy(run, marks_dir, last_version)
    if final > live.end_version:
        live.end_version = final
    if last_version is not None and live.end_version >= last_version:
        live.ended_by = "steps"


def run_arm_until_end(job: ArmRun) -> dict[str, Any]:
    """The arm's run, from a fresh directory until its minutes or steps: what it saw, with
    ``mark_versions`` (mark, minute, policy version) still to be evaluated."""
    spec, arm, seed, directory = job.spec, job.arm, job.seed, job.directory
    run = prepare_arm(job.out, arm, seed)
    settings, scale = arm_settings(arm, seed, spec.base_settings(), job.warm)
    config = directory / "coevolve.yaml"
    config.write_text(yaml.safe_dump(settings))
    pacer = None
    if arm == "random":
        reference = result_path(job.results, "coevolve", seed)
        curve = read_json(reference)["added_minutes"] if reference.exists() else []
        pacer = Pacer(curve)
    feed = None
    if arm == "labelled_control":
        feed = LabelledFeed(labelled_control_tasks(spec, seed), spec.pacing())
    until = f"{spec.minutes:g} min" + (f" or {spec.steps} steps" if spec.steps else "")
    job.say(f"{until} in {run}")
    # read as the services start: the working tree may change while the arm runs
    started_code, started_from = code_version(), provenance()
    with start_up(run, directory / "up.log", job.base_run_dir, config, scale) as up:
        live = anyio.run(
            functools.partial(control_arm, up=up, progress=job.say, labelled_feed=feed),
            up.nats_url(),
            run,
            directory / "marks",
            spec,
            up.started,
            pacer,
            seed,
        )
    settle_end(live, run, directory / "marks", spec.steps)
    marks = [(f"{m:g}", m, v) for m, v in sorted(live.mark_versions.items())]
    marks.append((END_MARK, live.end_minute, live.end_version))
    return {
        "setting": spec.setting(),
        "arm": arm,
        "seed": seed,
        "minutes": spec.minutes,
        "steps": spec.steps,
        "ended_by": live.ended_by,
        "end_minute": live.end_minute,
        "code_version": started_code,
        **started_from,
        "warm_start_sha256": job.warm.sha256,
        "started_at": up.started_at,
        "requests_sent": live.requests_sent,
        "labelled_sent": live.labelled_sent,
        "added_minutes": live.added_minutes,
        # sampled while it ran and once more as it stopped
        "cpu_seconds": up.cpu.totals(),
        "mark_versions": marks,
    }


def check_same_experiment(spec: ExperimentSpec, results: Path) -> None:
    """Refuse to add runs to ``results`` when it holds another experiment (other minutes,
    steps, held-out sample or setting: a resume without its ``--config`` would mix labelled
    arms into a no-label experiment); then record ``spec`` there."""
    spec_file = results / "experiment.json"
    current = {**asdict(spec), "setting": spec.setting()}
    if spec_file.exists():
        old = read_json(spec_file)
        for key in ("minutes", "steps", "eval_tasks", "setting"):
            # files written before the setting was recorded lack it
            if key in old and old[key] != current[key]:
                raise ResultsMismatchError(
                    f"{results} holds an experiment with {key} = {old[key]}, "
                    f"not {current[key]}" + (" (its --config?)" if key == "setting" else "")
                )
    write_json(spec_file, current)


def run_experiment(
    spec: ExperimentSpec,
    out: Path,
    results: Path,
    base_run_dir: Path,
    log: Callable[[str], None] = print,
    max_runs: int | None = None,
) -> list[tuple[str, int]]:
    """The warm start (committed, or made once), v1's scores once, then every pending arm
    x seed (the first ``max_runs`` of them, when given); returns those run."""
    spec.check()
    # absolute: the run directory in every command line is what finds leftover processes
    out, results = out.resolve(), results.resolve()
    out.mkdir(parents=True, exist_ok=True)
    check_same_experiment(spec, results)
    todo = pending(spec, results, max_runs)
    if not todo:
        log("[experiment] every arm x seed is finished")
        return []
    log(f"[experiment] running {', '.join(f'{arm} s{seed}' for arm, seed in todo)}")
    warm = ensure_warm_start(out, results, base_run_dir, log, base_config_file(spec, out))
    if not (results / WARM_EVAL_FILE).exists():
        log("[experiment] evaluating the warm start (v1)")
        scores = evaluate(
            warm.path,
            out / "warm" / "run",
            spec.eval_tasks,
            out / "warm" / "eval-v1-report.json",
            spec.eval_max_steps,
            spec.world(),
        )
        record = {
            "setting": spec.setting(),
            "arm": "warm_start",  # v1, adopted by every arm
            "seed": None,
            "ended_by": "v1",  # the warm start stops once it has written v1
            "steps": 0,
            "scored_version": 1,
            **provenance(),
            "warm_start_sha256": warm.sha256,
        }
        write_json(results / WARM_EVAL_FILE, {**scores, **record})
    for arm, seed in todo:
        run_arm(ArmRun(spec, out, results, arm, seed, warm, base_run_dir, log))
    return todo
