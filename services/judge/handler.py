"""The judge's work without the bus: a task candidate in, its verdict out.

Stages, cheapest first; the first that fails rejects the candidate and the later ones
never run: replay (``replay.py``), the deterministic semantic checks (``checks.py``:
the parent's failed functions exercised, plain and not a template, arguments named,
description covered, minimality, intent), the round trip if enabled
(``roundtrip.py``, an LLM solver), then the LLM judge (``prompts.py``). Each check is a
criterion of the verdict. The judge service publishes what :func:`judge_candidate`
returns; the lockstep schedule records it in the pool itself. Nothing here knows about
NATS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import anyio
import msgspec
from opentelemetry.trace import NoOpTracer, Tracer

from coevolve.services.judge.checks import semantic_checks
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.prompts import JUDGE_SCHEMA, Judgment, decide, judge_messages
from coevolve.services.judge.replay import ReplayCheck, replay_candidate
from coevolve.services.judge.roundtrip import round_trip
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.llm import RoleLLM
from coevolve.shared.messages import Task, TaskCandidate, Verdict, derived_id
from coevolve.shared.runtime.telemetry import current_trace_id
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured


@dataclass
class JudgeDeps:
    """What judging needs besides the candidate."""

    llm: RoleLLM
    config: JudgeConfig
    judgments: RejectionCounter  # unusable judge outputs, by kind
    tracer: Tracer = field(default_factory=NoOpTracer)


@dataclass(frozen=True)
class Judged:
    verdict: Verdict
    # accepted, rejected_by_replay, rejected_by_checks, rejected_by_round_trip,
    # rejected_by_judge, judge_output_rejected
    outcome: str
    rejection: Rejection | None  # the judge's unusable output, when it was one


async def judge_candidate(candidate: TaskCandidate, deps: JudgeDeps) -> Judged:
    """Replay the candidate's ground truth, run the semantic checks, the round trip (if
    enabled), then ask the judge role, stopping at the first stage that rejects it.

    The verdict's lineage carries the current trace id. Raises only ``LLMUnavailable``.
    """
    task = candidate.task
    environment = task.environment

    def make_env() -> Environment:
        return make_environment(environment)

    config = deps.config
    with deps.tracer.start_as_current_span("judge replay"):
        check = await anyio.to_thread.run_sync(replay_candidate, task, make_env)
    criteria = dict(check.criteria)
    rejection: Rejection | None = None
    accepted, reasons, outcome = False, check.problems(), "rejected_by_replay"
    going = check.passed
    if going:
        with deps.tracer.start_as_current_span("judge checks"):
            results = await anyio.to_thread.run_sync(
                partial(
                    semantic_checks,
                    task,
                    make_env,
                    minimality=config.minimality,
                    relevance=config.relevance,
                    backend=config.relevance_backend,
                )
            )
        criteria.update({result.name: result.passed for result in results})
        reasons = [reason for result in results for reason in result.reasons]
        outcome = "rejected_by_checks"
        going = all(result.passed for result in results)
    if going and config.round_trip:
        with deps.tracer.start_as_current_span("judge round trip"):
            trip = await round_trip(
                deps.llm,
                task,
                make_env,
                max_tokens=config.round_trip_max_tokens,
                counter=deps.judgments,
            )
        criteria[trip.name] = trip.passed
        reasons, outcome = list(trip.reasons), "rejected_by_round_trip"
        going = trip.passed
    if going and not config.llm_judge:
        accepted, reasons, outcome = True, [], "accepted"
    elif going:
        with deps.tracer.start_as_current_span("judge ask"):
            judged = await ask_judgment(deps.llm, task, check, config.max_tokens, deps.judgments)
        if isinstance(judged, Rejection):
            rejection = judged
        accepted, reasons, llm_criteria, outcome = judgment_outcome(judged)
        criteria.update(llm_criteria)
    verdict = verdict_of(candidate, accepted, reasons, criteria, current_trace_id())
    return Judged(verdict, outcome, rejection)


async def ask_judgment(
    llm: RoleLLM, task: Task, check: ReplayCheck, max_tokens: int, counter: RejectionCounter
) -> Judgment | Rejection:
    """The judge role's rating of ``task`` over its replay, or why its output is unusable
    (counted in ``counter``). Raises only ``LLMUnavailable``."""
    return await ask_structured(
        llm,
        judge_messages(task, check.observations, check.errors, check.self_score),
        Judgment,
        schema=JUDGE_SCHEMA,
        max_tokens=max_tokens,
        temperature=llm.settings.temperature,
        counter=counter,
    )


def judgment_outcome(judged: Judgment | Rejection) -> tuple[bool, list[str], dict[str, bool], str]:
    """(accepted, reasons, criteria, outcome label) from the judge's answer: an unusable
    answer rejects the candidate with that reason."""
    if isinstance(judged, Rejection):
        reason = f"judge output unusable ({judged.kind}): {judged.reason[:200]}"
        return False, [reason], {}, "judge_output_rejected"
    accepted, reasons, criteria = decide(judged)
    return accepted, reasons, criteria, "accepted" if accepted else "rejected_by_judge"


def verdict_of(
    candidate: TaskCandidate,
    accepted: bool,
    reasons: list[str],
    criteria: dict[str, bool],
    trace_id: str | None,
) -> Verdict:
    """The verdict on ``candidate``, its task's lineage completed with the verdict id."""
    task = candidate.task
    verdict_id = derived_id("verdict", candidate.id)
    lineage = msgspec.structs.replace(
        task.lineage,
        candidate_id=task.lineage.candidate_id or candidate.id,
        verdict_id=verdict_id,
        trace_id=trace_id,
    )
    return Verdict(
        id=verdict_id,
        candidate_id=candidate.id,
        accepted=accepted,
        reasons=reasons,
        task=msgspec.structs.replace(task, lineage=lineage),
        criteria=criteria,
    )
