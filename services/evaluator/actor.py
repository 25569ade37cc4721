"""evaluator: policy announcements in, held-out scores out (files and TensorBoard).

Optional (``services.evaluator.enabled``). It listens to the learner's announcements as
rollout workers do; when a version is due (``VersionSchedule``) it fetches and verifies
its weights and scores them on the run's held-out sample in a child process
(``handler.main``), which writes ``eval/latest.json``, the version's report and the
``eval/*`` scalars. A failed evaluation is logged and the service waits for the next
version.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec

from coevolve.services.evaluator.config import EvaluatorConfig
from coevolve.services.evaluator.handler import (
    BFCL_EVAL_SPLIT,
    EvaluationJob,
    HeldOutSample,
    VersionSchedule,
    evaluation_job,
    held_out_sample,
    own_held_out,
)
from coevolve.services.evaluator.scores import WORK_DIR, HeldOutScore, read_latest
from coevolve.shared.config import Settings
from coevolve.shared.messages import PolicyVersion
from coevolve.shared.runtime.actor import Actor
from coevolve.shared.runtime.subjects import POLICY_UPDATES

log = logging.getLogger(__name__)


class EvaluationFailed(RuntimeError):
    pass


class EvaluatorActor(Actor):
    name = "evaluator"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, EvaluatorConfig)
        latest = read_latest(settings.run_dir)
        self.schedule = VersionSchedule(
            self.config.every_versions, latest.version if latest is not None else None
        )
        self.sample: HeldOutSample | None = None
        self.scores: list[HeldOutScore] = []
        self.failures = 0
        # set when an announcement is newer than any before (made in setup: an event
        # needs the running event loop)
        self._wake: anyio.Event | None = None

    async def setup(self) -> None:
        from coevolve.cli.eval_cmd import world_classes
        from coevolve.shared.policy_sync import latest_policy

        self._wake = anyio.Event()
        classes = world_classes(None, self.settings)
        own = await anyio.to_thread.run_sync(own_held_out, self.config, self.settings)
        self.sample = await anyio.to_thread.run_sync(
            held_out_sample, self.config, classes, self.settings.run_dir, own
        )
        source = own.source if own is not None else BFCL_EVAL_SPLIT
        if not self.sample.drawn_as(self.config, classes, source):
            log.warning(
                "scoring the run's kept sample (%d turns of %s, seed %d), not a new one "
                "as configured: every version of a run is scored on the same turns",
                len(self.sample.task_ids),
                self.sample.suite,
                self.sample.seed,
            )
        log.info(
            "held-out sample: %d turns of the %s; scoring every %d versions (last scored: %s)",
            len(self.sample.task_ids),
            self.sample.source,
            self.config.every_versions,
            self.schedule.last_scored,
        )
        self.schedule.offer(await latest_policy(self.bus))

    def loops(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        return (self.follow_announcements, self.score_due_versions)

    async def follow_announcements(self) -> None:
        await self.bus.follow(POLICY_UPDATES, PolicyVersion, self.offer)

    def offer(self, update: PolicyVersion) -> None:
        if self.schedule.offer(update) and self._wake is not None:
            self._wake.set()

    async def score_due_versions(self) -> None:
        while True:
            update = self.schedule.due()
            if update is None:
                assert self._wake is not None
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            scored = False
            self.report_progress("evaluating", detail=f"v{update.version} on held-out turns")
            try:
                score = await self.score(update)
                scored = True
            except Exception as exc:  # this version is lost; the next may be scored
                self.failures += 1
                log.error("held-out evaluation of v%d failed: %s", update.version, exc)
                await self.metric("evaluation_failures", float(self.failures))
            finally:
                self.schedule.tried(update.version, scored=scored)
                self.clear_progress()
            if scored:
                self.scores.append(score)
                log.info(
                    "held-out accuracy %.3f at v%d (%d turns, %.0f s)",
                    score.accuracy,
                    score.version,
                    score.n,
                    score.seconds,
                )
                await self.metric("heldout_accuracy", score.accuracy, step=score.version)

    async def score(self, update: PolicyVersion) -> HeldOutScore:
        """Fetch ``update``'s weights and score them in a child process."""
        from coevolve.shared.policy_sync import fetch_policy

        assert self.sample is not None
        blob = await fetch_policy(self.bus, update)
        work = self.settings.run_dir / WORK_DIR
        weights = work / f"v{update.version}.safetensors"
        job_file = work / f"v{update.version}.job.json"
        job = evaluation_job(
            self.config,
            self.sample,
            version=update.version,
            weights=weights,
            run_dir=self.settings.run_dir,
            tool_rendering=self.settings.tool_rendering,
            environments=self.settings.environments,
        )
        try:
            await anyio.to_thread.run_sync(_write_job, job, blob, job_file)
            await self.run_job(job_file)
        finally:
            weights.unlink(missing_ok=True)
            job_file.unlink(missing_ok=True)
        latest = read_latest(self.settings.run_dir)
        if latest is None or latest.version != update.version:
            raise EvaluationFailed(f"the evaluation of v{update.version} recorded no score")
        return latest

    async def run_job(self, job_file: Path) -> None:
        """Run the child (its output goes to this service's log); killed if cancelled or
        past ``timeout_s``."""
        argv = [sys.executable, "-m", "coevolve.services.evaluator.handler", str(job_file)]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.config.threads)}
        with anyio.fail_after(self.config.timeout_s):
            done = await anyio.run_process(argv, stdout=None, stderr=None, env=env, check=False)
        if done.returncode != 0:
            raise EvaluationFailed(f"the evaluation process exited with {done.returncode}")


def _write_job(job: EvaluationJob, blob: bytes, job_file: Path) -> None:
    job_file.parent.mkdir(parents=True, exist_ok=True)
    Path(job.weights).write_bytes(blob)
    job_file.write_bytes(msgspec.json.encode(job))


def build(settings: Settings) -> Actor:
    return EvaluatorActor(settings)
