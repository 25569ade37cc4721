"""Every subject, stream, consumer and bucket name, in one place.

All subjects live under ``coevolve.`` so a user can subscribe to one kind or all
(``coevolve.signals.>``). Work-queue streams are bounded and refuse new messages when
full (``discard=new``): a publisher that hits the bound backs off, which is the
backpressure of the whole system.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PREFIX = "coevolve"

# agent loop
ROLLOUT_JOBS = f"{PREFIX}.rollout.jobs"
ROLLOUT_GROUPS = f"{PREFIX}.rollout.groups"
ROLLOUT_RESULTS = f"{PREFIX}.rollout.results"
POLICY_UPDATES = f"{PREFIX}.policy.updates"
# the failure agent's versions (learner.grpo.preference.failure_agent), apart from the
# target's so that every reader of POLICY_UPDATES sees the target alone
FAILURE_POLICY_UPDATES = f"{PREFIX}.policy.failure_updates"

# data loop
SIGNALS = f"{PREFIX}.signals"  # + ".<kind>"
SIGNALS_ALL = f"{SIGNALS}.>"
EXPLORATION_REQUESTS = f"{PREFIX}.explore.requests"
EXPLORATIONS = f"{PREFIX}.explorations"
CANDIDATES = f"{PREFIX}.candidates"
VERDICTS = f"{PREFIX}.verdicts"
TASK_ADDED = f"{PREFIX}.pool.task_added"
# self-navigating: experiences the distiller drew from rollout groups, for pool-store
EXPERIENCES = f"{PREFIX}.experiences"

# benchmarks only (core NATS, never captured by a stream)
BENCH_CORE = f"{PREFIX}.bench.core"

# pool-store request/reply
POOL_RPC = f"{PREFIX}.pool.rpc"  # reads: sample, get, stats, lineage
# tasks added by hand (operators); the services add tasks only through verdicts
POOL_ADD = f"{PREFIX}.pool.add"

# operations
HEARTBEATS = f"{PREFIX}.heartbeat"  # + ".<service>"
METRICS = f"{PREFIX}.metrics"  # + ".<service>"
DEAD_LETTERS = f"{PREFIX}.dlq"  # + ".<service>"

# object store and key-value buckets
POLICY_BUCKET = "coevolve-policy"
HEARTBEAT_BUCKET = "coevolve-heartbeats"


def signal_subject(kind: str) -> str:
    return f"{SIGNALS}.{kind}"


def heartbeat_subject(service: str) -> str:
    return f"{HEARTBEATS}.{service}"


def metrics_subject(service: str) -> str:
    return f"{METRICS}.{service}"


def dead_letter_subject(service: str) -> str:
    return f"{DEAD_LETTERS}.{service}"


Retention = Literal["limits", "workqueue", "interest"]


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: Retention
    max_msgs: int
    max_bytes: int
    max_age_s: float = 0.0
    discard_new: bool = False
    duplicate_window_s: float = 600.0


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer; all replicas of a service share it (work-queue delivery)."""

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float = 60.0
    max_deliver: int = 5
    max_ack_pending: int = 64
    extra: dict[str, str] = field(default_factory=dict)


MiB = 1024 * 1024
DAY = 86_400.0

STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        "COEVOLVE_ROLLOUT_JOBS", (ROLLOUT_JOBS,), "workqueue", 256, 256 * MiB, discard_new=True
    ),
    # Two consumers (learner and signal-monitor) read every group: interest retention
    # keeps a group until both have acked it; rollout throttles on the learner's
    # pending count long before the bound binds.
    StreamSpec("COEVOLVE_ROLLOUT_GROUPS", (ROLLOUT_GROUPS,), "interest", 20_000, 2048 * MiB),
    StreamSpec("COEVOLVE_ROLLOUT_RESULTS", (ROLLOUT_RESULTS,), "workqueue", 100_000, 256 * MiB),
    StreamSpec(
        "COEVOLVE_POLICY", (POLICY_UPDATES, FAILURE_POLICY_UPDATES), "limits", 1000, 16 * MiB
    ),
    StreamSpec("COEVOLVE_SIGNALS", (SIGNALS_ALL,), "workqueue", 10_000, 1024 * MiB),
    StreamSpec(
        "COEVOLVE_EXPLORE_REQUESTS", (EXPLORATION_REQUESTS,), "workqueue", 10_000, 256 * MiB
    ),
    StreamSpec("COEVOLVE_EXPLORATIONS", (EXPLORATIONS,), "workqueue", 10_000, 1024 * MiB),
    StreamSpec("COEVOLVE_CANDIDATES", (CANDIDATES,), "workqueue", 50_000, 512 * MiB),
    StreamSpec("COEVOLVE_VERDICTS", (VERDICTS,), "workqueue", 50_000, 512 * MiB),
    StreamSpec("COEVOLVE_TASK_EVENTS", (TASK_ADDED,), "limits", 100_000, 64 * MiB, 7 * DAY),
    StreamSpec("COEVOLVE_EXPERIENCES", (EXPERIENCES,), "workqueue", 10_000, 64 * MiB),
    StreamSpec("COEVOLVE_DEAD_LETTERS", (f"{DEAD_LETTERS}.>",), "limits", 100_000, 512 * MiB),
)

STREAM_BY_NAME = {s.name: s for s in STREAMS}


def stream_for(subject: str) -> StreamSpec:
    for spec in STREAMS:
        for pattern in spec.subjects:
            if pattern == subject or (pattern.endswith(".>") and subject.startswith(pattern[:-1])):
                return spec
    raise KeyError(f"no stream captures subject {subject!r}")


# Durable consumers, one per consuming service and input.
ROLLOUT_JOBS_CONSUMER = ConsumerSpec("COEVOLVE_ROLLOUT_JOBS", "rollout", ROLLOUT_JOBS, 900.0)
LEARNER_GROUPS_CONSUMER = ConsumerSpec(
    "COEVOLVE_ROLLOUT_GROUPS", "learner", ROLLOUT_GROUPS, 600.0, max_ack_pending=256
)
MONITOR_GROUPS_CONSUMER = ConsumerSpec(
    "COEVOLVE_ROLLOUT_GROUPS", "signal_monitor", ROLLOUT_GROUPS, 60.0
)
POOL_RESULTS_CONSUMER = ConsumerSpec("COEVOLVE_ROLLOUT_RESULTS", "pool_store", ROLLOUT_RESULTS)
EXPLORER_SIGNALS_CONSUMER = ConsumerSpec("COEVOLVE_SIGNALS", "explorer", SIGNALS_ALL, 900.0)
EXPLORER_REQUESTS_CONSUMER = ConsumerSpec(
    "COEVOLVE_EXPLORE_REQUESTS", "explorer", EXPLORATION_REQUESTS, 900.0
)
ABSTRACTOR_CONSUMER = ConsumerSpec("COEVOLVE_EXPLORATIONS", "abstractor", EXPLORATIONS, 600.0)
JUDGE_CONSUMER = ConsumerSpec("COEVOLVE_CANDIDATES", "judge", CANDIDATES, 600.0)
POOL_VERDICTS_CONSUMER = ConsumerSpec("COEVOLVE_VERDICTS", "pool_store", VERDICTS)
POOL_EXPERIENCES_CONSUMER = ConsumerSpec("COEVOLVE_EXPERIENCES", "pool_store", EXPERIENCES)

CONSUMERS: tuple[ConsumerSpec, ...] = (
    ROLLOUT_JOBS_CONSUMER,
    LEARNER_GROUPS_CONSUMER,
    MONITOR_GROUPS_CONSUMER,
    POOL_RESULTS_CONSUMER,
    EXPLORER_SIGNALS_CONSUMER,
    EXPLORER_REQUESTS_CONSUMER,
    ABSTRACTOR_CONSUMER,
    JUDGE_CONSUMER,
    POOL_VERDICTS_CONSUMER,
    POOL_EXPERIENCES_CONSUMER,
)

# `up` starts these at a lower CPU priority (runtime.background_niceness): the services that
# make and check new tasks, and the evaluator, take what the learner and rollout leave
BACKGROUND_SERVICES: tuple[str, ...] = (
    "signal_monitor",
    "explorer",
    "abstractor",
    "judge",
    "evaluator",
    "distiller",
)
# every service: the learning loop's three, then the background ones
SERVICES: tuple[str, ...] = ("pool_store", "rollout", "learner", *BACKGROUND_SERVICES)
# started by `coevolve up` only when their section enables them (services.<name>.enabled)
OPTIONAL_SERVICES: tuple[str, ...] = ("evaluator", "distiller")
# the optional services whose section enables them by default
ENABLED_BY_DEFAULT: tuple[str, ...] = ()
# what `coevolve up` starts on the defaults
DEFAULT_SERVICES: tuple[str, ...] = tuple(
    s for s in SERVICES if s not in OPTIONAL_SERVICES or s in ENABLED_BY_DEFAULT
)
