"""Synthesis benchmark: how many accepted tasks each role model makes of the same
recorded explorations.

The inputs are fixed: the 16 explorations a default run recorded
(``docs/results/explorations-20261126-run10.jsonl``, as the explorer's ``record`` writes
them). For each model of ``ROLE_MODELS`` one local llama.cpp server serves every LLM role
(abstractor, judge, the judge's round-trip solver, a default run's settings). Each
exploration goes through the abstractor's handler and each candidate through the judge's,
their dependencies built as the services build them, without the bus (the abstractor
de-duplicates against a pool seeded with BFCL's train split). The judge runs the round
trip, not the LLM judge: ``passed_checks`` is what the default judge accepts, ``accepted``
what also passes the round trip. Per model also: ``s_per_candidate``, the abstractor's
drops and the judge's rejections by reason, and each accepted task for a person to label.
``--quick``: the first 4 explorations. Server threads: ``OMP_NUM_THREADS``, else 1.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from coevolve.bench import tables
from coevolve.bench.local_llm import served_roles
from coevolve.experiment.machine import cpu_flags
from coevolve.harness import base_run_dir as default_base
from coevolve.harness import output_dir
from coevolve.schedules.synthesis import PoolFile
from coevolve.services.abstractor.config import AbstractorConfig
from coevolve.services.abstractor.handler import (
    Abstraction,
    AbstractorDeps,
    abstract,
    similarity_cache_dir,
)
from coevolve.services.judge.checks import call_text
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import Judged, JudgeDeps, judge_candidate
from coevolve.services.pool_store.handler import seed_tasks_for
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.llm import LLMServerError, LLMUnavailable, Role, RoleLLM, ServerSettings
from coevolve.shared.llm.model_file import ROLE_MODELS
from coevolve.shared.messages import Exploration, Task
from coevolve.shared.similarity import LeakGuard
from coevolve.shared.structured import RejectionCounter

ROOT = Path(__file__).resolve().parents[1]
INPUTS = Path("docs/results/explorations-20261126-run10.jsonl")
MODEL_CHOICES = ROLE_MODELS  # --models
QUICK_EXPLORATIONS = 4
SERVED_ROLES: tuple[Role, ...] = ("abstractor", "judge")  # the round-trip solver is the judge's
# outcomes of candidates that never got past the deterministic stages
CHECK_OUTCOMES = frozenset({"rejected_by_replay", "rejected_by_checks"})

# model alias, run directory -> the roles' clients on that model for the block
Serve = Callable[[str, Path], AbstractAsyncContextManager[Mapping[Role, RoleLLM]]]


@dataclass(frozen=True)
class Setup:
    """The abstractor's and judge's sections as the benchmark runs them."""

    abstractor: AbstractorConfig = field(default_factory=AbstractorConfig)
    # the round trip on (off by default in a run), so round_trip_pass means something; the
    # LLM judge off, as by default (the 0.5B rejected every sound BFCL turn it saw)
    judge: JudgeConfig = field(default_factory=lambda: JudgeConfig(round_trip=True))


progress = tables.progress("synthesis")


def load_explorations(path: Path, limit: int | None = None) -> list[Exploration]:
    """The explorations of a record file (msgspec JSON, one a line), the first ``limit``."""
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    return [msgspec.json.decode(line, type=Exploration) for line in lines[:limit]]


def server_threads() -> int:
    """The LLM server's threads: ``OMP_NUM_THREADS``, else 1 (as every model process here)."""
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def local_roles(model: str, run_dir: Path) -> AbstractAsyncContextManager[Mapping[Role, RoleLLM]]:
    """A llama.cpp server with ``model`` for the block, every role on it."""
    settings = ServerSettings(model=model, n_threads=server_threads())
    return served_roles(settings, SERVED_ROLES, run_dir)


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and whether it has native bfloat16 dot products."""
    model, flags = cpu_flags()
    return {"model": model, "avx512_bf16": "avx512_bf16" in flags if flags else None}


def for_labelling(task: Task) -> dict[str, Any]:
    """An accepted task as a person reads it: the request and the calls."""
    return {
        "id": task.id,
        "request": "\n".join(task.user_turns),
        "calls": [call_text(call) for turn in task.ground_truth for call in turn],
    }


@dataclass
class Tally:
    """What one model made of the explorations."""

    explorations: int = 0
    call_units: int = 0
    candidates: int = 0
    accepted: int = 0
    passed_checks: int = 0
    round_trip_pass: int = 0
    seconds: float = 0.0
    abstractor_rejections: Counter[str] = field(default_factory=Counter)
    judge_rejections: Counter[str] = field(default_factory=Counter)
    judge_outcomes: Counter[str] = field(default_factory=Counter)
    judge_unusable_outputs: Counter[str] = field(default_factory=Counter)  # by kind
    accepted_tasks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def add_abstraction(self, abstraction: Abstraction) -> None:
        self.explorations += 1
        self.call_units += abstraction.drafts
        self.candidates += len(abstraction.candidates)
        self.abstractor_rejections.update(reason for reason, _ in abstraction.dropped)
        self.abstractor_rejections.update(
            f"unusable_output:{rejection.kind}" for rejection in abstraction.rejections
        )

    def add_judged(self, judged: Judged) -> None:
        verdict = judged.verdict
        self.judge_outcomes[judged.outcome] += 1
        self.passed_checks += judged.outcome not in CHECK_OUTCOMES
        self.round_trip_pass += verdict.criteria.get("round_trip") is True
        if verdict.accepted:
            self.accepted += 1
            self.accepted_tasks.append(for_labelling(verdict.task))
            return
        failed = [name for name, passed in verdict.criteria.items() if not passed]
        # the LLM judge can reject with every criterion holding, and an unusable answer
        # has none: the outcome names the stage then
        self.judge_rejections.update(failed or [judged.outcome])

    def report(self) -> dict[str, Any]:
        per_candidate = self.seconds / self.candidates if self.candidates else None
        row: dict[str, Any] = {
            "explorations": self.explorations,
            "call_units": self.call_units,
            "candidates": self.candidates,
            "accepted": self.accepted,
            "passed_checks": self.passed_checks,
            "round_trip_pass": self.round_trip_pass,
            "s_per_candidate": None if per_candidate is None else round(per_candidate, 2),
            "seconds": round(self.seconds, 2),
            "abstractor_rejections": dict(self.abstractor_rejections),
            "judge_rejections": dict(self.judge_rejections),
            "judge_outcomes": dict(self.judge_outcomes),
            "judge_unusable_outputs": dict(self.judge_unusable_outputs),
            "accepted_tasks": self.accepted_tasks,
        }
        if self.error is not None:
            row["error"] = self.error
        return row


async def synthesize(
    model: str,
    explorations: Sequence[Exploration],
    abstractor: AbstractorDeps,
    judge: JudgeDeps,
) -> Tally:
    """Each exploration through the abstractor, each candidate through the judge; an LLM
    that becomes unreachable ends the pass (what was done is kept)."""
    tally = Tally()
    started = time.perf_counter()
    try:
        for number, exploration in enumerate(explorations, start=1):
            abstraction = await abstract(exploration, abstractor)
            tally.add_abstraction(abstraction)
            for candidate in abstraction.candidates:
                tally.add_judged(await judge_candidate(candidate, judge))
            progress(
                f"{model}: exploration {number}/{len(explorations)}: "
                f"+{len(abstraction.candidates)} candidates ({tally.candidates} in all, "
                f"{tally.accepted} accepted, {time.perf_counter() - started:.0f} s)"
            )
    except LLMUnavailable as exc:
        tally.error = f"the LLM became unavailable: {exc}"
    tally.seconds = time.perf_counter() - started
    # the round-trip solver's and the judge's answers that could not be used
    tally.judge_unusable_outputs.update(judge.judgments.rejected)
    return tally


async def measure_model(
    model: str,
    explorations: Sequence[Exploration],
    serve: Serve,
    pool: PoolFile,
    guard: LeakGuard | None,
    setup: Setup,
    run_dir: Path,
    cache_dir: Path,
) -> dict[str, Any]:
    """One model's pass, its de-duplication texts fresh; an error row when its server
    cannot start (the 1.5B model is installed only on request)."""
    progress(f"{model}: starting its server")
    try:
        async with serve(model, run_dir / model) as roles:
            abstractor = AbstractorDeps(
                roles["abstractor"], setup.abstractor, pool, cache_dir, leak_guard=guard
            )
            judge = JudgeDeps(roles["judge"], setup.judge, RejectionCounter())
            tally = await synthesize(model, explorations, abstractor, judge)
    except LLMServerError as exc:
        progress(f"{model}: no server: {exc}")
        return {"error": f"the LLM server did not start: {exc}"}
    return tally.report()


async def measure_models(
    models: Sequence[str],
    explorations: Sequence[Exploration],
    serve: Serve,
    pool: PoolFile,
    setup: Setup,
    run_dir: Path,
    cache_dir: Path,
) -> dict[str, dict[str, Any]]:
    """Each model's row, one after the other, with one leak guard built for all."""
    guard: LeakGuard | None = None
    if setup.abstractor.leak_guard:
        progress("building the eval leak guard")
        config = setup.abstractor
        guard = await asyncio.to_thread(
            lambda: LeakGuard(backend=config.leak_backend, cache_dir=cache_dir)
        )
    return {
        model: await measure_model(
            model, explorations, serve, pool, guard, setup, run_dir, cache_dir
        )
        for model in models
    }


def seeded_pool(path: Path) -> PoolStore:
    """A DuckDB pool at ``path`` holding BFCL's train split as seed tasks."""
    store = PoolStore(path)
    try:
        store.add_tasks(seed_tasks_for("bfcl"))
    except BaseException:
        store.close()
        raise
    return store


def run(
    quick: bool,
    serve: Serve | None = None,
    setup: Setup | None = None,
    inputs: Path | None = None,
    base_run_dir: Path | None = None,
    models: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The benchmark's report (see the module docstring); ``serve``, ``setup``, ``inputs``
    and ``models`` replace the local servers, the sections, the explorations and the
    models compared (tests)."""
    setup = setup or Setup()
    source = inputs or ROOT / INPUTS
    explorations = load_explorations(source, QUICK_EXPLORATIONS if quick else None)
    models = list(models or ROLE_MODELS)
    base = base_run_dir or default_base()
    run_dir = output_dir("synthesis", base)
    # the embedding index of the eval queries outlives this run, as in a default run's
    cache_dir = similarity_cache_dir(setup.abstractor, base.resolve())
    progress(f"{len(explorations)} explorations, models {', '.join(models)}; {run_dir}")
    with seeded_pool(run_dir / "pool.duckdb") as store:
        results = asyncio.run(
            measure_models(
                models,
                explorations,
                serve or local_roles,
                PoolFile(store),
                setup,
                run_dir,
                cache_dir,
            )
        )
    report: dict[str, Any] = {
        "benchmark": "synthesis",
        "quick": quick,
        "inputs": {
            "path": str(INPUTS if inputs is None else source),
            "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
            "explorations": len(explorations),
        },
        "models": results,
        "cpu": cpu_info(),
        "threads": server_threads(),
        "judge": {"round_trip": setup.judge.round_trip, "llm_judge": setup.judge.llm_judge},
        "run_dir": str(run_dir),
    }
    print_table(report)
    return report


def print_table(report: dict[str, Any]) -> None:
    counts = {  # column: key of a model's row
        "explorations": "explorations",
        "candidates": "candidates",
        "passed checks": "passed_checks",
        "round trip": "round_trip_pass",
        "accepted": "accepted",
    }
    columns = ("model", *counts, "s/cand", "seconds")
    rows: list[tuple[object, ...]] = []
    lines: list[str] = []
    for model, row in report["models"].items():
        if "error" in row:
            lines.append(f"{model}: {row['error']}")
        if "candidates" not in row:
            rows.append((model, *[None] * (len(columns) - 1)))
            continue
        per = row["s_per_candidate"]
        rows.append(
            (
                model,
                *(row[key] for key in counts.values()),
                None if per is None else f"{per:.1f}",
                f"{row['seconds']:.0f}",
            )
        )
        lines += [
            f"{model}: abstractor dropped {row['abstractor_rejections']}",
            f"{model}: judge rejected, by check {row['judge_rejections']}",
            *(
                f"{model}: accepted {task['request']!r} -> {'; '.join(task['calls'])}"
                for task in row["accepted_tasks"]
            ),
        ]
    tables.print_table(
        f"synthesis of {report['inputs']['explorations']} recorded explorations, "
        f"{report['cpu']['model']}, {report['threads']} server thread(s)",
        columns,
        rows,
        note="\n".join(lines),
    )
