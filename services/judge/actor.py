"""judge: task candidates in, verdicts out (``coevolve.verdicts``, recorded by pool-store).

Per candidate: replay its ground truth in a fresh environment and score it against itself
(``replay.py``); a candidate failing those automatic checks is rejected without asking the
LLM. Otherwise the judge role rates the five criteria over the replay (``prompts.py``) and
``decide`` accepts only when the judge accepts and every criterion holds. An unusable
judge output is a counted rejection and the candidate is rejected with that reason (never
retried forever, never a crash). Every verdict, accepted or not, is published with an id
derived from the candidate id, the automatic and LLM criteria, and the lineage completed
with the verdict id and the current trace id.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec

from coevolve.services.judge.prompts import JUDGE_SCHEMA, Judgment, decide, judge_messages
from coevolve.services.judge.replay import ReplayCheck, replay_candidate
from coevolve.shared.actor import Actor, Consumer, Delivery
from coevolve.shared.config import Settings
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.llm import RoleClients, RoleLLM
from coevolve.shared.messages import Task, TaskCandidate, Verdict, derived_id
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured, report_rejection
from coevolve.shared.subjects import JUDGE_CONSUMER, VERDICTS
from coevolve.shared.telemetry import current_trace_id

log = logging.getLogger(__name__)

RECENT_IDS = 10_000


class JudgeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 200
    concurrency: int = 1


class JudgeActor(Actor):
    name = "judge"

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, JudgeConfig)
        self._own_llm = llm is None
        self.llm = llm or RoleClients.from_section(
            settings.services.get("llm"), settings.run_dir, roles=("judge",)
        )
        self.judgments = RejectionCounter()
        self.outcomes: Counter[str] = Counter()
        # ids of recent candidates judged (bounded: the service runs for days)
        self.handled: deque[str] = deque(maxlen=RECENT_IDS)

    async def teardown(self) -> None:
        if self._own_llm:
            await self.llm.aclose()

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (
            Consumer(JUDGE_CONSUMER, TaskCandidate, self.on_candidate, self.config.concurrency),
        )

    async def on_candidate(self, candidate: TaskCandidate, _: Delivery) -> None:
        task = candidate.task
        environment = task.environment

        def make_env() -> Environment:
            return make_environment(environment)

        with self.tracer.start_as_current_span("judge replay"):
            check = await anyio.to_thread.run_sync(replay_candidate, task, make_env)
        criteria = dict(check.criteria)
        if not check.passed:
            accepted, reasons, outcome = False, check.problems(), "rejected_by_replay"
        else:
            accepted, reasons, llm_criteria, outcome = await self._ask_judge(candidate, check)
            criteria.update(llm_criteria)
        verdict = verdict_of(candidate, accepted, reasons, criteria, current_trace_id())
        await self.publish(VERDICTS, verdict)
        self.handled.append(candidate.id)
        self.outcomes[outcome] += 1
        log.info("candidate %s: %s (%s)", candidate.id, outcome, "; ".join(reasons)[:200])
        await self.metric("verdicts", self.outcomes[outcome], outcome=outcome)

    async def _ask_judge(
        self, candidate: TaskCandidate, check: ReplayCheck
    ) -> tuple[bool, list[str], dict[str, bool], str]:
        """(accepted, reasons, criteria, outcome label) from the LLM judge."""
        with self.tracer.start_as_current_span("judge ask"):
            judged = await ask_judgment(
                self.llm["judge"], candidate.task, check, self.config.max_tokens, self.judgments
            )
        if isinstance(judged, Rejection):
            about = f"candidate {candidate.id}"
            await report_rejection(self.metric, "judge", self.judgments, judged, about)
        return judgment_outcome(judged)


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


def build(settings: Settings) -> Actor:
    return JudgeActor(settings)
