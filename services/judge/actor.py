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
from collections import Counter
from collections.abc import Sequence
from typing import Any

from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import JudgeDeps, judge_candidate
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients
from coevolve.shared.llm.role_actor import RoleActor
from coevolve.shared.messages import TaskCandidate
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery
from coevolve.shared.runtime.subjects import JUDGE_CONSUMER, VERDICTS
from coevolve.shared.structured import RejectionCounter, report_rejection

log = logging.getLogger(__name__)


class JudgeActor(RoleActor):
    name = "judge"
    roles = ("judge",)

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings, llm)
        self.config = settings.section(self.name, JudgeConfig)
        self.judgments = RejectionCounter()
        self.outcomes: Counter[str] = Counter()

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
        self.outcomes[judged.outcome] += 1
        reasons = "; ".join(judged.verdict.reasons)[:200]
        log.info("candidate %s: %s (%s)", candidate.id, judged.outcome, reasons)
        await self.metric("verdicts", self.outcomes[judged.outcome], outcome=judged.outcome)


def build(settings: Settings) -> Actor:
    return JudgeActor(settings)
