"""judge: task candidates in, verdicts out (``coevolve.verdicts``, recorded by pool-store).

Per candidate: replay its ground truth in a fresh environment and score it against itself
(``replay.py``); a candidate failing those automatic checks is rejected without asking the
LLM. Otherwise the judge role rates the five criteria over the replay (``prompts.py``) and
``decide`` accepts only when the judge accepts and every criterion holds. An unusable
judge output is a counted rejection and the candidate is rejected with that reason (never
retried forever, never a crash). Every verdict, accepted or not, is published with an id
derived from the candidate id, the automatic and LLM criteria, and the lineage completed
with the verdict id and the current trace id.

The work is ``handler.judge_candidate`` (no bus); this actor publishes the verdict it
returns and reports the counts.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from coevolve.services.judge.handler import JudgeConfig, JudgeDeps, judge_candidate
from coevolve.shared.actor import Actor, Consumer, Delivery
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients
from coevolve.shared.messages import TaskCandidate
from coevolve.shared.structured import RejectionCounter, report_rejection
from coevolve.shared.subjects import JUDGE_CONSUMER, VERDICTS

log = logging.getLogger(__name__)

RECENT_IDS = 10_000


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
        deps = JudgeDeps(self.llm["judge"], self.config, self.judgments, self.tracer)
        judged = await judge_candidate(candidate, deps)
        if judged.rejection is not None:
            about = f"candidate {candidate.id}"
            await report_rejection(self.metric, "judge", self.judgments, judged.rejection, about)
        await self.publish(VERDICTS, judged.verdict)
        self.handled.append(candidate.id)
        self.outcomes[judged.outcome] += 1
        reasons = "; ".join(judged.verdict.reasons)[:200]
        log.info("candidate %s: %s (%s)", candidate.id, judged.outcome, reasons)
        await self.metric("verdicts", self.outcomes[judged.outcome], outcome=judged.outcome)


def build(settings: Settings) -> Actor:
    return JudgeActor(settings)
