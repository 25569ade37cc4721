"""What a run's bus carried, as a caller outside the run sees it: every ``coevolve.>``
message passed to :meth:`BusTally.observe` (``coevolve.harness.watch_bus`` does), counted
by subject family with the time of each family's first message, and what the harness's
callers wait on or audit: verdicts, the latest policy version, each service's latest
heartbeat, the rollout groups published and the groups the learner dropped as stale.

A message published again after a crash carries the same ``Nats-Msg-Id`` and is counted
once (``duplicates`` says how many were seen again)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from coevolve.shared.messages import (
    DecodeError,
    Heartbeat,
    Metric,
    PolicyVersion,
    RolloutGroup,
    Verdict,
    decode,
)
from coevolve.shared.runtime.bus import MSG_ID_HEADER
from coevolve.shared.runtime.subjects import (
    CANDIDATES,
    DEAD_LETTERS,
    EXPLORATION_REQUESTS,
    EXPLORATIONS,
    HEARTBEATS,
    METRICS,
    POLICY_UPDATES,
    ROLLOUT_GROUPS,
    ROLLOUT_JOBS,
    ROLLOUT_RESULTS,
    SIGNALS,
    TASK_ADDED,
    VERDICTS,
    metrics_subject,
)

EXACT_FAMILIES: dict[str, str] = {
    ROLLOUT_JOBS: "rollout_jobs",
    ROLLOUT_GROUPS: "rollout_groups",
    ROLLOUT_RESULTS: "rollout_results",
    POLICY_UPDATES: "policy_updates",
    EXPLORATION_REQUESTS: "exploration_requests",
    EXPLORATIONS: "explorations",
    CANDIDATES: "candidates",
    VERDICTS: "verdicts",
    TASK_ADDED: "tasks_added",
}
PREFIX_FAMILIES: dict[str, str] = {
    f"{SIGNALS}.": "signals",
    f"{DEAD_LETTERS}.": "dead_letters",
    f"{HEARTBEATS}.": "heartbeats",
    f"{METRICS}.": "metrics",
}
LEARNER_METRICS = metrics_subject("learner")


def family_of(subject: str) -> str:
    if subject in EXACT_FAMILIES:
        return EXACT_FAMILIES[subject]
    for prefix, family in PREFIX_FAMILIES.items():
        if subject.startswith(prefix):
            return family
    return "other"


@dataclass
class BusTally:
    """What the bus carried since ``started_at`` (monotonic seconds)."""

    started_at: float = field(default_factory=time.monotonic)
    counts: Counter[str] = field(default_factory=Counter)
    signals_by_kind: Counter[str] = field(default_factory=Counter)
    first_seen_s: dict[str, float] = field(default_factory=dict)
    verdicts: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    undecodable: int = 0
    policy_version: int = 0
    services_running_s: dict[str, float] = field(default_factory=dict)
    beats: dict[str, Heartbeat] = field(default_factory=dict)  # the latest, by service
    groups: set[str] = field(default_factory=set)  # ids of the rollout groups published
    dropped_stale: dict[int, float] = field(default_factory=dict)  # learner step -> groups
    _seen_ids: set[str] = field(default_factory=set, repr=False)

    def observe(
        self,
        subject: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
        at: float | None = None,
    ) -> None:
        elapsed = round((time.monotonic() if at is None else at) - self.started_at, 1)
        message_id = (headers or {}).get(MSG_ID_HEADER)
        if message_id is not None:
            if message_id in self._seen_ids:
                self.duplicates += 1
                return
            self._seen_ids.add(message_id)
        family = family_of(subject)
        self.counts[family] += 1
        self.first_seen_s.setdefault(family, elapsed)
        try:
            self._look_inside(family, subject, data, elapsed, message_id)
        except DecodeError:
            self.undecodable += 1

    def _look_inside(
        self, family: str, subject: str, data: bytes, elapsed: float, message_id: str | None
    ) -> None:
        if family == "signals":
            kind = subject.removeprefix(f"{SIGNALS}.")
            self.signals_by_kind[kind] += 1
            self.first_seen_s.setdefault(f"signals.{kind}", elapsed)
        elif family == "verdicts":
            accepted = decode(data, Verdict).accepted
            self.verdicts["accepted" if accepted else "rejected"] += 1
            if accepted:
                self.first_seen_s.setdefault("accepted_verdict", elapsed)
        elif family == "policy_updates":
            version = decode(data, PolicyVersion).version
            self.policy_version = max(self.policy_version, version)
            # v1 is the warm start; a GRPO step makes v2 and later
            self.first_seen_s.setdefault("warm_start" if version <= 1 else "grpo_update", elapsed)
        elif family == "heartbeats":
            beat = decode(data, Heartbeat)
            self.beats[beat.service] = beat
            if beat.phase == "running":
                self.services_running_s.setdefault(beat.service, elapsed)
        elif family == "rollout_groups":
            self.groups.add(message_id or decode(data, RolloutGroup).id)
        elif subject == LEARNER_METRICS:
            metric = decode(data, Metric)
            if metric.name == "dropped_stale":
                self.dropped_stale[metric.step] = metric.value

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at
