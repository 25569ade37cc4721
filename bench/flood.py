"""Flood benchmark: malformed and hostile messages on every consumed subject, good traffic
alongside, on real NATS with a real pool-store and signal-monitor (``coevolve serve``).

The subjects of the model services (rollout jobs, signals, exploration requests,
explorations, candidates) are consumed by a stand-in actor with those services' durable
consumers and message types: validation and dead-lettering are the runtime's, the same
in every service. Each bad message is one of ``BAD_KINDS``: random bytes, a wrong schema
version or message type, or a well-formed message with absurd values (negative K, NaN
rewards, inf log-probs, an unknown task id, a trajectory of millions of tokens), plus one
10 MB message the broker refuses. The bench measures the good messages processed per
second without the flood and during it, then audits the dead letters: every bad message
that reached the bus must be dead-lettered exactly once, and no service may have died.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.errors
import yaml

from coevolve.bench import tables
from coevolve.harness import spawn_group, stream_messages, wait_for
from coevolve.processes import stop_process_group
from coevolve.services.signal_monitor.state import StateStore
from coevolve.shared.config import BusSettings, Settings, load_settings
from coevolve.shared.messages import (
    SCHEMA_VERSION,
    DeadLetter,
    Exploration,
    ExplorationRequest,
    Heartbeat,
    Message,
    RolloutGroup,
    RolloutJob,
    RolloutResults,
    SampleBatch,
    ScoreSample,
    Signal,
    Task,
    TaskCandidate,
    Trajectory,
    Verdict,
    decode,
    new_id,
)
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import Actor, ActorRunner, Consumer, Delivery
from coevolve.shared.runtime.bus import MSG_ID_HEADER, Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import (
    ABSTRACTOR_CONSUMER,
    CANDIDATES,
    DEAD_LETTERS,
    EXPLORATION_REQUESTS,
    EXPLORATIONS,
    EXPLORER_REQUESTS_CONSUMER,
    EXPLORER_SIGNALS_CONSUMER,
    JUDGE_CONSUMER,
    POOL_RPC,
    ROLLOUT_GROUPS,
    ROLLOUT_JOBS,
    ROLLOUT_JOBS_CONSUMER,
    ROLLOUT_RESULTS,
    VERDICTS,
    signal_subject,
)

FLOOD_KIND_HEADER = "Coevolve-Flood-Kind"
FLOOD_ID_HEADER = "Coevolve-Flood-Id"
SERVICES_UNDER_TEST = ("pool_store", "signal_monitor")
# far above the trajectory bound, under the broker's 8 MiB max_payload: it reaches a service
HUGE_TRAJECTORY_TOKENS = 2_500_000
OVERSIZED_BYTES = 10 * 1024 * 1024
SAMPLES_PER_RESULT = 4
PUBLISH_WINDOW = 64  # publishes awaiting their acks at once, per sender
START_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- bad messages


@dataclass(frozen=True)
class BadMessage:
    subject: str
    kind: str
    payload: bytes
    id: str

    @property
    def is_request(self) -> bool:
        return self.subject == POOL_RPC


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Mutation:
    """Set a dotted path (``trajectories.0.reward``) in a message's builtins."""

    def apply(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


def _unknown_task(body: dict[str, Any]) -> None:
    body["task_id"] = f"no-such-task-{new_id()[:8]}"
    for trajectory in body["trajectories"]:
        trajectory["task_id"] = body["task_id"]


def _huge_trajectory(body: dict[str, Any]) -> None:
    trajectory = body["trajectories"][0]
    trajectory["token_ids"] = [1000] * HUGE_TRAJECTORY_TOKENS
    trajectory["logprobs"], trajectory["loss_mask"] = [], []


def _trajectory(task_id: str) -> Trajectory:
    return Trajectory(
        id=new_id(),
        task_id=task_id,
        messages=[],
        token_ids=[1, 2, 3, 4],
        logprobs=[0.0, 0.0, -0.3, -1.2],
        loss_mask=[0, 0, 1, 1],
        reward=1.0,
        policy_version=1,
        entropies=[0.5],
    )


def _templates(task: Task) -> dict[str, tuple[Message, dict[str, Mutation]]]:
    """For each consumed subject: a valid message and the absurd values to give it."""
    group = RolloutGroup(
        task_id=task.id, origin="seed", policy_version=1, trajectories=[_trajectory(task.id)]
    )
    return {
        ROLLOUT_JOBS: (
            RolloutJob(task=task),
            {
                "negative_group_size": _set("group_size", -8),
                "zero_group_size": _set("group_size", 0),
                "absurd_group_size": _set("group_size", 10**9),
            },
        ),
        ROLLOUT_GROUPS: (
            group,
            {
                "nan_reward": _set("trajectories.0.reward", float("nan")),
                "inf_logprob": _set("trajectories.0.logprobs.2", float("-inf")),
                "negative_token_id": _set("trajectories.0.token_ids.0", -1),
                "mismatched_lengths": _set("trajectories.0.loss_mask", [1]),
                "negative_policy_version": _set("policy_version", -3),
                "unknown_task_id": _unknown_task,
            },
        ),
        ROLLOUT_RESULTS: (
            RolloutResults(
                group_id=new_id(),
                samples=[ScoreSample(task_id=task.id, policy_version=1, score=1.0, length=9)],
            ),
            {
                "nan_score": _set("samples.0.score", float("nan")),
                "inf_score": _set("samples.0.score", float("inf")),
                "negative_length": _set("samples.0.length", -5),
            },
        ),
        signal_subject("boundary"): (
            Signal(
                kind="boundary",
                task=task,
                trajectory=_trajectory(task.id),
                group_id=group.id,
                policy_version=1,
            ),
            {
                "nan_reward": _set("trajectory.reward", float("nan")),
                "unknown_signal_kind": _set("kind", "gibberish"),
            },
        ),
        EXPLORATION_REQUESTS: (
            ExplorationRequest(task=task),
            {"negative_rounds": _set("rounds", -1), "absurd_rounds": _set("rounds", 10**6)},
        ),
        EXPLORATIONS: (
            Exploration(mode="guided", task=task, rounds=[]),
            {"unknown_mode": _set("mode", "sideways")},
        ),
        CANDIDATES: (
            TaskCandidate(exploration_id=new_id(), task=task),
            {"wrong_field_type": _set("task.user_turns", "not a list")},
        ),
        VERDICTS: (
            Verdict(candidate_id=new_id(), accepted=True, reasons=[], task=task),
            {
                "forged_origin": _set("task.origin", "forged"),
                "wrong_field_type": _set("accepted", "yes"),
            },
        ),
        POOL_RPC: (
            SampleBatch(size=4),
            {"negative_size": _set("size", -5), "absurd_size": _set("size", 10**9)},
        ),
    }


GENERIC_KINDS = ("random_bytes", "newer_schema", "zero_schema", "wrong_message_type")


def bad_messages(count: int, task: Task, seed: int = 0) -> list[BadMessage]:
    """``count`` bad messages spread evenly over every (subject, kind), shuffled; the
    first two are the huge trajectory (dead-lettered) and the oversized one (refused)."""
    rng = random.Random(seed)
    templates = _templates(task)
    combos: list[tuple[str, str]] = [
        (subject, kind)
        for subject, (_, specific) in templates.items()
        for kind in (*GENERIC_KINDS, *specific)
    ]
    messages = [_bad(ROLLOUT_GROUPS, "huge_trajectory", templates, rng)]
    if count > 1:
        oversized = rng.randbytes(OVERSIZED_BYTES)
        messages.append(BadMessage(ROLLOUT_GROUPS, "oversized_10mb", oversized, new_id()))
    cycle = itertools.cycle(combos)
    while len(messages) < count:
        subject, kind = next(cycle)
        messages.append(_bad(subject, kind, templates, rng))
    head, tail = messages[:2], messages[2:]
    rng.shuffle(tail)
    return head + tail


def _bad(
    subject: str,
    kind: str,
    templates: dict[str, tuple[Message, dict[str, Mutation]]],
    rng: random.Random,
) -> BadMessage:
    message_id = new_id()
    if kind == "random_bytes":
        return BadMessage(subject, kind, rng.randbytes(rng.randint(1, 2048)), message_id)
    template, specific = templates[subject]
    body: dict[str, Any] = msgspec.to_builtins(template)
    body["id"] = message_id
    if kind == "newer_schema":
        body["schema"] = SCHEMA_VERSION + 1
    elif kind == "zero_schema":
        body["schema"] = 0
    elif kind == "wrong_message_type":
        body = msgspec.to_builtins(
            Heartbeat(id=message_id, service="x", instance="y", pid=1, host="h", started_at=0.0)
        )
    elif kind == "huge_trajectory":
        _huge_trajectory(body)
    else:
        specific[kind](body)
    return BadMessage(subject, kind, msgspec.msgpack.encode(body), message_id)


# --------------------------------------------------------------------------- stand-in


class StandIn(Actor):
    """The model services' consumers (rollout, explorer, abstractor, judge) without the
    models: same durable consumers, same message types; a good message is just counted."""

    name = "stand_in"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.handled: Counter[str] = Counter()

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (
            Consumer(ROLLOUT_JOBS_CONSUMER, RolloutJob, self.on_message, concurrency=4),
            Consumer(EXPLORER_SIGNALS_CONSUMER, Signal, self.on_message, concurrency=4),
            Consumer(EXPLORER_REQUESTS_CONSUMER, ExplorationRequest, self.on_message),
            Consumer(ABSTRACTOR_CONSUMER, Exploration, self.on_message),
            Consumer(JUDGE_CONSUMER, TaskCandidate, self.on_message),
        )

    async def on_message(self, message: Message, _: Delivery) -> None:
        self.handled[type(message).__name__] += 1


# --------------------------------------------------------------------------- services


def write_bare_pool_config(path: Path) -> Path:
    """A configuration file for a pool-store that starts at once and holds only the tasks
    its caller adds: no seeding from BFCL (slow to start), no jobs fed, no telemetry."""
    path.write_text(
        yaml.safe_dump(
            {
                "services": {"pool_store": {"feed_jobs": False, "seed_environments": []}},
                "telemetry": {"exporter": "none"},
                "runtime": {"fetch_timeout_s": 0.3},
            }
        )
    )
    return path


@dataclass
class Services:
    """pool-store and signal-monitor as ``coevolve serve`` processes."""

    run_dir: Path
    nats_url: str
    processes: dict[str, subprocess.Popen[bytes]]

    @classmethod
    def start(cls, run_dir: Path, nats_url: str) -> Services:
        config = write_bare_pool_config(run_dir / "flood.yaml")
        env = {**os.environ, "NATS_URL": nats_url, "HF_HUB_OFFLINE": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        serve = [sys.executable, "-m", "coevolve", "serve"]
        options = ["--run-dir", str(run_dir), "--config", str(config)]
        processes = {
            name: spawn_group([*serve, name, *options], env, run_dir / "logs" / f"{name}.log")
            for name in SERVICES_UNDER_TEST
        }
        return cls(run_dir, nats_url, processes)

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.processes.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            stop_process_group(process, grace_s=15, sig=signal.SIGTERM)


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Poll ``condition`` until true; the monotonic time it became true."""
    if await wait_for(condition, timeout_s, poll_s=0.05) is None:
        raise TimeoutError(f"flood bench: timed out after {timeout_s} s waiting for {what}")
    return time.monotonic()


# --------------------------------------------------------------------------- traffic


@dataclass
class Traffic:
    """Good traffic on ``bus``; the flood on ``flood_bus``, a connection of its own."""

    bus: Bus
    flood_bus: Bus
    pool: PoolClient
    monitor_state: StateStore
    tasks: list[Task]

    async def results_recorded(self) -> int:
        return (await self.pool.stats()).results

    async def groups_seen(self) -> int:
        state = await anyio.to_thread.run_sync(self.monitor_state.load)
        return state.groups_processed

    def good(self, count: int) -> list[tuple[str, Message]]:
        """``count`` rollout results (pool-store) and ``count`` groups (signal-monitor)."""
        traffic: list[tuple[str, Message]] = []
        for i in range(count):
            task = self.tasks[i % len(self.tasks)]
            samples = [
                ScoreSample(task_id=task.id, policy_version=1, score=float(k % 2), length=10)
                for k in range(SAMPLES_PER_RESULT)
            ]
            traffic.append((ROLLOUT_RESULTS, RolloutResults(group_id=new_id(), samples=samples)))
            trajectories = [_trajectory(task.id) for _ in range(4)]
            group = RolloutGroup(
                task_id=task.id, origin="seed", policy_version=1, trajectories=trajectories
            )
            traffic.append((ROLLOUT_GROUPS, group))
        return traffic

    async def send_bad(self, bad: BadMessage) -> str:
        """Publish one bad message: "sent", or "refused" when the bus will not take it."""
        headers = {FLOOD_KIND_HEADER: bad.kind, FLOOD_ID_HEADER: bad.id, MSG_ID_HEADER: bad.id}
        bus = self.flood_bus
        try:
            if bad.is_request:
                await bus.nc.request(bad.subject, bad.payload, timeout=30, headers=headers)
            else:
                await bus.js.publish(bad.subject, bad.payload, timeout=30, headers=headers)
        except nats.errors.MaxPayloadError:
            return "refused"
        return "sent"

    async def phase(self, good: int, bad: Sequence[BadMessage]) -> dict[str, Any]:
        """Send ``good`` of each good kind as fast as the bus takes them while another
        connection floods ``bad``; measure how fast the good ones are processed."""
        results_before = await self.results_recorded()
        groups_before = await self.groups_seen()
        traffic = self.good(good)
        outcome: Counter[str] = Counter()
        flood_done: list[float] = []

        async def flood() -> None:
            for start in range(0, len(bad), PUBLISH_WINDOW):
                chunk = bad[start : start + PUBLISH_WINDOW]
                await asyncio.gather(*(self._count(outcome, self.send_bad(b)) for b in chunk))
            flood_done.append(time.monotonic())

        started = time.monotonic()
        flooding = asyncio.create_task(flood())
        for start in range(0, len(traffic), PUBLISH_WINDOW):
            chunk = traffic[start : start + PUBLISH_WINDOW]
            await asyncio.gather(*(self.bus.publish(subject, m) for subject, m in chunk))
        published = time.monotonic()

        async def results_done() -> bool:
            return await self.results_recorded() >= results_before + good * SAMPLES_PER_RESULT

        async def groups_done() -> bool:
            return await self.groups_seen() >= groups_before + good

        results_at = await _until(results_done, DRAIN_TIMEOUT_S, "the good rollout results")
        groups_at = await _until(groups_done, DRAIN_TIMEOUT_S, "the good rollout groups")
        await flooding
        return {
            "good_results": good,
            "good_groups": good,
            "bad_messages": len(bad),
            "bad_sent": outcome["sent"],
            "bad_refused_by_bus": outcome["refused"],
            "good_publish_s": round(published - started, 3),
            "flood_publish_s": round(flood_done[0] - started, 3),
            # the flood was still being sent when the last good message was processed
            "flood_outlasted_good": flood_done[0] >= max(results_at, groups_at),
            "results_per_s": round(good / (results_at - started), 1),
            "groups_per_s": round(good / (groups_at - started), 1),
        }

    @staticmethod
    async def _count(outcome: Counter[str], send: Awaitable[str]) -> None:
        outcome[await send] += 1


async def read_dead_letters(bus: Bus, expected: int, timeout_s: float) -> list[DeadLetter]:
    """Every dead letter in the stream once ``expected`` are there (or the time is up)."""

    async def enough() -> bool:
        info = await bus.js.stream_info("COEVOLVE_DEAD_LETTERS")
        return int(info.state.messages) >= expected

    # the audit reports what is missing
    await wait_for(enough, timeout_s, poll_s=0.05)
    await asyncio.sleep(1.0)  # a late duplicate would show up now
    stored = await stream_messages(bus, "COEVOLVE_DEAD_LETTERS")
    prefix = f"{DEAD_LETTERS}."
    return [decode(d, DeadLetter) for subject, d in stored if d and subject.startswith(prefix)]


def reason_of(letter: DeadLetter) -> str:
    """The kind of reason a dead letter gives."""
    text = letter.reason
    if text.startswith("rejected:"):
        return "rejected by the handler"
    if text.startswith("invalid "):
        return "failed validation"
    if "schema" in text and ("newer than" in text or "$.schema" in text):
        return "unsupported schema"
    if "finite" in text:
        return "non-finite number"
    if ">=" in text or "<=" in text or "length" in text:
        return "value out of range"
    if text.startswith("handler failed"):
        return "handler failed"
    return "undecodable or wrong type"


def audit(bad: Sequence[BadMessage], letters: Sequence[DeadLetter]) -> dict[str, Any]:
    sent = {b.id: b for b in bad if b.kind != "oversized_10mb"}
    lettered = Counter(
        letter.headers[FLOOD_ID_HEADER] for letter in letters if FLOOD_ID_HEADER in letter.headers
    )
    by_reason = Counter(reason_of(letter) for letter in letters)
    by_kind = Counter(
        letter.headers.get(FLOOD_KIND_HEADER, "good traffic (unexpected)") for letter in letters
    )
    by_service = Counter(letter.service for letter in letters)
    return {
        "dead_letters": len(letters),
        "bad_missing": sorted({b.kind for i, b in sent.items() if i not in lettered}),
        "bad_missing_count": sum(1 for i in sent if i not in lettered),
        "dead_lettered_twice": sum(1 for n in lettered.values() if n > 1),
        "good_dead_lettered": sum(1 for letter in letters if FLOOD_ID_HEADER not in letter.headers),
        "by_reason": dict(by_reason.most_common()),
        "by_kind": dict(sorted(by_kind.items())),
        "by_service": dict(sorted(by_service.items())),
    }


# --------------------------------------------------------------------------- the bench


async def measure(bad_count: int, good: int, run_dir: Path) -> dict[str, Any]:
    with NatsServer(run_dir / "nats", log_file=run_dir / "logs" / "nats.log") as server:
        services = Services.start(run_dir, server.url)
        settings = load_settings(run_dir=str(run_dir))
        settings.bus = BusSettings(url=server.url, request_timeout_s=30.0)
        settings.telemetry.exporter = "none"
        settings.runtime.fetch_timeout_s = 0.3
        bus = await Bus.connect(settings.bus, "flood-bench")
        flood_bus = await Bus.connect(settings.bus, "flood-bench-flood")
        stand_in = StandIn(settings)
        runner = ActorRunner(stand_in)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: runner.run(handle_signals=False))
                result = await _flood(bus, flood_bus, services, bad_count, good, run_dir)
                result["stand_in"] = {
                    "handled": dict(stand_in.handled),
                    "dead_lettered": runner.stats.dead_lettered,
                }
                runner.request_stop()
        finally:
            await bus.close()
            await flood_bus.close()
            services.stop()
    return result


async def _flood(
    bus: Bus, flood_bus: Bus, services: Services, bad_count: int, good: int, run_dir: Path
) -> dict[str, Any]:
    pool = PoolClient(bus, timeout_s=30.0)

    async def pool_ready() -> bool:
        if not all(services.alive().values()):
            raise RuntimeError(f"a service exited during start-up; logs in {run_dir / 'logs'}")
        try:
            await pool.stats()
            return True
        except Exception:
            return False

    await _until(pool_ready, START_TIMEOUT_S, "pool-store")
    tasks = [
        Task(id=f"flood-task-{i}", environment="bfcl", user_turns=[f"list the files of dir{i}"])
        for i in range(32)
    ]
    await pool.add_tasks(tasks)
    state = StateStore(run_dir / "signal_monitor" / "state.json")
    traffic = Traffic(bus, flood_bus, pool, state, tasks)
    # one group first: signal-monitor has started and its state file exists
    await bus.publish(ROLLOUT_GROUPS, traffic.good(1)[1][1])
    await _until(lambda: _state_exists(traffic), START_TIMEOUT_S, "signal-monitor")

    baseline = await traffic.phase(good, [])
    bad = bad_messages(bad_count, tasks[0])
    flood = await traffic.phase(good, bad)
    letters = await read_dead_letters(bus, flood["bad_sent"], DRAIN_TIMEOUT_S)
    # a request after the flood is still answered
    answered = await pool.get(tasks[0].id)
    alive = services.alive()
    return {
        "benchmark": "flood",
        "services_alive": alive,
        "pool_answers_after_flood": answered is not None,
        "without_flood": baseline,
        "during_flood": flood,
        "ratio_during_over_without": {
            "results": round(flood["results_per_s"] / baseline["results_per_s"], 3),
            "groups": round(flood["groups_per_s"] / baseline["groups_per_s"], 3),
        },
        "audit": audit(bad, letters),
    }


async def _state_exists(traffic: Traffic) -> bool:
    return traffic.monitor_state.path.exists() and await traffic.groups_seen() >= 1


def run(quick: bool = False, bad: int | None = None, good: int | None = None) -> dict[str, Any]:
    bad_count = bad if bad is not None else (500 if quick else 10_000)
    good_count = good if good is not None else (100 if quick else 400)
    with tempfile.TemporaryDirectory(prefix="coevolve-flood-") as tmp:
        result = asyncio.run(measure(bad_count, good_count, Path(tmp)))
    result["quick"] = quick
    _print(result)
    return result


def _print(result: dict[str, Any]) -> None:
    base, flood, audit_ = result["without_flood"], result["during_flood"], result["audit"]
    tables.print_table(
        f"flood benchmark: {flood['bad_messages']} bad messages "
        f"({flood['bad_refused_by_bus']} refused by the bus), {flood['good_results']} good "
        "rollout results and groups per phase",
        ("good traffic", "without flood", "during flood", "ratio"),
        [
            (label, base[key], flood[key], result["ratio_during_over_without"][ratio])
            for key, label, ratio in (
                ("results_per_s", "pool-store results/s", "results"),
                ("groups_per_s", "signal-monitor groups/s", "groups"),
            )
        ],
        note=f"flood sent in {flood['flood_publish_s']} s on its own connection; still flooding "
        f"when the last good message was processed: {flood['flood_outlasted_good']}",
    )
    tables.print_table(
        f"dead letters: {audit_['dead_letters']}; bad messages not dead-lettered: "
        f"{audit_['bad_missing_count']}; dead-lettered twice: {audit_['dead_lettered_twice']}; "
        f"good ones dead-lettered: {audit_['good_dead_lettered']}",
        ("dead-letter reason", "messages"),
        list(audit_["by_reason"].items()),
        note=f"services alive at the end: {result['services_alive']}",
    )
