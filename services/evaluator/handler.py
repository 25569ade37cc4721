"""The evaluator's work: score one policy version on the run's fixed held-out turns with
``coevolve eval``'s player, scorer and engine options, and record the score.

Which turns: ``held_out_sample`` draws ``tasks`` turns of the eval split once per run
(``coevolve eval --sample N --seed S`` on the run's world) and keeps their ids in the run
directory, so every version is scored on the same turns. Which versions: the newest one
announced, once ``every_versions`` versions came after the last one scored
(``VersionSchedule``); versions announced while an evaluation runs are never queued.

An evaluation runs in a child process (``python -m coevolve.services.evaluator.handler
JOB``; ``evaluate_version`` is its body): the eval's llama.cpp engine holds its base model
and KV cache in native memory that is freed only when its process ends, and a child can
be killed at once when the service stops.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from coevolve.cli.eval_cmd import PlayOptions, build_player, pick_tasks
from coevolve.services.evaluator.config import EvaluatorConfig
from coevolve.services.evaluator.scores import (
    MEASURES,
    REPORTS_DIR,
    SAMPLE_FILE,
    TENSORBOARD_DIR,
    HeldOutScore,
    write_latest,
)
from coevolve.shared.config import EngineKind, Settings
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.envs.rendering import ToolRendering, configure_tool_rendering
from coevolve.shared.evaluation import SuiteReport, run_suite
from coevolve.shared.messages import PolicyVersion, Task
from coevolve.shared.task_sets import load_d0, load_heldout_file

log = logging.getLogger(__name__)

EVAL_SPLIT = "eval"


BFCL_EVAL_SPLIT = "bfcl eval split"
D0_SLICE = "D0 held-out slice"


class HeldOutSample(msgspec.Struct, kw_only=True, frozen=True):
    """The held-out turns of a run: drawn once, then read back (``SAMPLE_FILE``)."""

    suite: str
    classes: list[str] | None  # the world they were drawn from (None: all of BFCL)
    seed: int
    requested: int  # the turns asked for (more than the world holds: all of them)
    task_ids: list[str]
    # where they come from: BFCL_EVAL_SPLIT, "file PATH" or "D0 held-out slice"; the
    # tasks themselves when they are not BFCL's
    source: str = BFCL_EVAL_SPLIT
    environment: str = "bfcl"
    own_tasks: list[Task] = msgspec.field(default_factory=list)

    def drawn_as(
        self, config: EvaluatorConfig, classes: list[str] | None, source: str = BFCL_EVAL_SPLIT
    ) -> bool:
        """Whether ``config`` in the world of ``classes`` would draw this sample."""
        world = sorted(classes) if classes is not None else None
        return (self.suite, self.seed, self.requested, self.classes, self.source) == (
            config.suite,
            config.seed,
            config.tasks,
            world,
            source,
        )

    def tasks(self) -> list[Task]:
        """The sample's turns, in suite order."""
        if self.own_tasks:
            return list(self.own_tasks)
        wanted = set(self.task_ids)
        found = [t for t in suite_tasks(self.suite, EVAL_SPLIT, self.classes) if t.id in wanted]
        missing = wanted - {t.id for t in found}
        if missing:
            raise ValueError(
                f"{len(missing)} held-out turns of the sample are not in {self.suite} "
                f"(e.g. {sorted(missing)[0]}): was BFCL's data changed?"
            )
        return found


class OwnHeldOut(msgspec.Struct, kw_only=True, frozen=True):
    """Held-out tasks that are not BFCL's eval split: where from, and the tasks."""

    source: str
    environment: str
    tasks: list[Task]


def own_held_out(config: EvaluatorConfig, settings: Settings) -> OwnHeldOut | None:
    """The user's held-out file, else in a user's environment the D0 file's held-out
    slice; None in the bfcl world with no file (its eval split). ValueError when a user's
    environment has neither."""
    environment = settings.d0.environment if settings.labels == "none" else "bfcl"
    if config.heldout_file is not None:
        path = Path(config.heldout_file).expanduser().resolve()
        tasks = load_heldout_file(path)
        return OwnHeldOut(source=f"file {path}", environment=tasks[0].environment, tasks=tasks)
    if environment == "bfcl":
        return None
    d0_path = settings.d0.path(settings.run_dir)
    heldout = load_d0(d0_path).heldout
    if not heldout:
        raise ValueError(
            f"no held-out tasks for environment {environment!r}: {d0_path} holds none "
            "(built with d0.heldout_every 0?); give services.evaluator.heldout_file"
        )
    return OwnHeldOut(source=D0_SLICE, environment=environment, tasks=heldout)


def held_out_sample(
    config: EvaluatorConfig,
    classes: list[str] | None,
    run_dir: Path,
    own: OwnHeldOut | None = None,
) -> HeldOutSample:
    """The run's held-out turns: those kept in ``run_dir``, else ``config.tasks`` turns
    drawn with ``config.seed`` from ``own`` tasks or the eval split of ``classes`` (and
    kept)."""
    path = run_dir / SAMPLE_FILE
    if path.is_file():
        return msgspec.json.decode(path.read_bytes(), type=HeldOutSample)
    world = sorted(classes) if classes is not None else None
    turns = own.tasks if own is not None else suite_tasks(config.suite, EVAL_SPLIT, world)
    drawn = pick_tasks(turns, None, config.tasks, config.seed)
    sample = HeldOutSample(
        suite=config.suite,
        classes=world,
        seed=config.seed,
        requested=config.tasks,
        task_ids=[t.id for t in drawn],
        source=own.source if own is not None else BFCL_EVAL_SPLIT,
        environment=own.environment if own is not None else "bfcl",
        own_tasks=drawn if own is not None else [],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_bytes(msgspec.json.format(msgspec.json.encode(sample)) + b"\n")
    partial.replace(path)
    return sample


class VersionSchedule:
    """Which announced version to score next: the newest, once ``every_versions`` versions
    came after the last one scored. Only the newest announcement is kept, so versions that
    come while an evaluation runs are skipped, never queued; a version is tried once."""

    def __init__(self, every_versions: int, last_scored: int | None = None) -> None:
        self.every_versions = every_versions
        self.last_scored = last_scored
        self.last_tried = last_scored
        self.newest: PolicyVersion | None = None

    def offer(self, update: PolicyVersion | None) -> bool:
        """Note an announcement; True when it is newer than any before."""
        if update is None or (self.newest is not None and update.version <= self.newest.version):
            return False
        self.newest = update
        return True

    def due(self) -> PolicyVersion | None:
        newest = self.newest
        if newest is None or (self.last_tried is not None and newest.version <= self.last_tried):
            return None
        if self.last_scored is not None and (
            newest.version - self.last_scored < self.every_versions
        ):
            return None
        return newest

    def tried(self, version: int, *, scored: bool) -> None:
        self.last_tried = version
        if scored:
            self.last_scored = version


class EvaluationJob(msgspec.Struct, kw_only=True, frozen=True):
    """What the child process scores: one version's weights on the sample, as configured."""

    version: int
    weights: str  # that version's exported weights (a .safetensors file)
    run_dir: str
    sample: HeldOutSample
    tool_rendering: ToolRendering
    model: str | None
    engine: EngineKind
    max_new_tokens: int
    max_steps_per_turn: int
    batch_size: int | None
    likelihood: bool
    threads: int
    # the configuration's `environments` section: the child registers the user's own
    environments: dict[str, Any] = msgspec.field(default_factory=dict)


def evaluation_job(
    config: EvaluatorConfig,
    sample: HeldOutSample,
    *,
    version: int,
    weights: Path,
    run_dir: Path,
    tool_rendering: ToolRendering,
    environments: dict[str, Any] | None = None,
) -> EvaluationJob:
    eval_defaults = PlayOptions()
    return EvaluationJob(
        version=version,
        weights=str(weights),
        run_dir=str(run_dir),
        sample=sample,
        tool_rendering=tool_rendering,
        model=config.model,
        engine=config.engine or eval_defaults.engine_kind,
        max_new_tokens=config.max_new_tokens or eval_defaults.max_new_tokens,
        max_steps_per_turn=config.max_steps_per_turn or eval_defaults.max_steps_per_turn,
        batch_size=config.batch_size,
        likelihood=config.likelihood,
        threads=config.threads,
        environments=environments or {},
    )


def score_policy(job: EvaluationJob) -> SuiteReport:
    """The report ``coevolve eval`` gives the job's weights on the sample (greedy)."""
    import torch

    configure_tool_rendering(job.tool_rendering)
    if job.environments:
        from coevolve.shared.envs.python_class import install_environments

        install_environments(job.environments)
    torch.set_num_threads(job.threads)  # the llama.cpp engine takes torch's thread count
    options = PlayOptions(
        max_steps_per_turn=job.max_steps_per_turn,
        max_new_tokens=job.max_new_tokens,
        batch_size=job.batch_size,
        likelihood=job.likelihood,
        engine_kind=job.engine,
    )
    player, batch_size, extra, scorer = build_player(
        job.weights, job.model, Path(job.run_dir), None, options, job.sample.environment
    )
    report = run_suite(
        job.sample.tasks(),
        player,
        suite=job.sample.suite,
        split=EVAL_SPLIT,
        policy=f"v{job.version}",
        batch_size=batch_size,
        progress=False,
        scorer=scorer,
    )
    report.extra.update(extra)
    report.extra.update(
        version=job.version,
        classes=job.sample.classes if job.sample.classes is not None else "all",
        sample=len(job.sample.task_ids),
        seed=job.sample.seed,
        heldout_source=job.sample.source,
    )
    return report


def record_score(report: SuiteReport, version: int, run_dir: Path) -> HeldOutScore:
    """Keep the full report, write the TensorBoard scalars (step = version) and
    ``eval/latest.json``; returns the score."""
    from torch.utils.tensorboard import SummaryWriter

    summary = report.summary()
    reports = run_dir / REPORTS_DIR
    reports.mkdir(parents=True, exist_ok=True)
    (reports / f"v{version}.json").write_text(json.dumps(report.to_json()) + "\n", "utf-8")
    writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))
    try:
        for name in MEASURES:
            if summary.get(name) is not None:
                writer.add_scalar(f"eval/{name}", float(summary[name]), version)
    finally:
        writer.close()
    score = HeldOutScore(
        version=version,
        accuracy=report.accuracy,
        n=report.n,
        time=time.time(),
        ci95_low=report.ci95[0],
        ci95_high=report.ci95[1],
        partial_credit_mean=report.partial_credit_mean,
        gt_logprob_per_token=report.gt_logprob_per_token,
        seconds=report.total_seconds,
        errors=int(summary["errors"]),
        source=str(report.extra.get("heldout_source", BFCL_EVAL_SPLIT)),
    )
    write_latest(run_dir, score)
    return score


def evaluate_version(job: EvaluationJob) -> HeldOutScore:
    """Score the job's version and record it under its run directory."""
    return record_score(score_policy(job), job.version, Path(job.run_dir))


def main(argv: list[str]) -> int:
    """The child process: ``python -m coevolve.services.evaluator.handler JOB_FILE``."""
    from coevolve.shared.runtime.child_process import terminate_with_parent

    terminate_with_parent()  # an evaluation outlives no evaluator
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if len(argv) != 1:
        print("usage: python -m coevolve.services.evaluator.handler JOB_FILE", file=sys.stderr)
        return 2
    job = msgspec.json.decode(Path(argv[0]).read_bytes(), type=EvaluationJob)
    score = evaluate_version(job)
    log.info(
        "v%d: accuracy %.3f on %d held-out turns in %.0f s",
        score.version,
        score.accuracy,
        score.n,
        score.seconds,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
