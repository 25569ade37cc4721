"""Notable events on the bus, one line each, for the terminal of ``coevolve up``.

The watcher only listens: a core NATS subscription per subject sees every message
published there without taking it from the JetStream consumers the services share.
Lines look like ``12:03:41  learner        policy v3  reward 0.42  kl 0.0012  staleness 0.8``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus
from nats.aio.subscription import Subscription

from coevolve.shared.config import BusSettings
from coevolve.shared.messages import (
    GRPO_STEP_PHASE,
    DeadLetter,
    Heartbeat,
    Metric,
    PolicyVersion,
    Signal,
    TaskAdded,
    Verdict,
    decode,
)
from coevolve.shared.runtime.bus import MSG_ID_HEADER, Bus, BusError
from coevolve.shared.runtime.subjects import (
    DEAD_LETTERS,
    HEARTBEATS,
    POLICY_UPDATES,
    SERVICES,
    SIGNALS,
    SIGNALS_ALL,
    TASK_ADDED,
    VERDICTS,
    metrics_subject,
)

log = logging.getLogger(__name__)

LEARNER_METRICS = metrics_subject("learner")
WATCHED: tuple[str, ...] = (
    f"{HEARTBEATS}.>",
    LEARNER_METRICS,
    POLICY_UPDATES,
    SIGNALS_ALL,
    VERDICTS,
    TASK_ADDED,
    f"{DEAD_LETTERS}.>",
)
# what a policy line shows, by the learner's metric names (StepMetrics.scalars())
POLICY_METRICS = {"reward_mean": "reward", "kl": "kl", "staleness_mean": "staleness"}
SOURCE_WIDTH = max(len(s) for s in SERVICES) + 2
NETWORK_TIMEOUT_S = 5.0
REASONS_CHARS = 120
RECENT_IDS = 4096  # message ids remembered to skip a retried publish


def progress_text(
    phase: str, done: int | None = None, total: int | None = None, detail: str = ""
) -> str:
    """``warm start 7/16  detail``: a phase with its progress, as status and up show it."""
    text = phase
    if done is not None:
        text += f" {done}/{total}" if total is not None else f" {done}"
    return f"{text}  {detail}" if detail else text


class EventPrinter:
    """Writes ``HH:MM:SS  source  text`` lines; shared by threads (supervisor, watcher)."""

    def __init__(
        self,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._write = write or _print_line
        self._clock = clock
        self._lock = threading.Lock()

    def line(self, source: str, text: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(self._clock()))
        with self._lock:
            try:
                self._write(f"{stamp}  {source:<{SOURCE_WIDTH}}{text}")
            except Exception as exc:  # a closed terminal must not stop `up`
                log.debug("could not write an event line: %r", exc)


def _print_line(line: str) -> None:
    print(line, flush=True)


@dataclass
class _Shown:
    """The last progress line printed for one service instance."""

    phase: str
    done: int | None
    at: float


@dataclass
class _PendingPolicy:
    update: PolicyVersion
    since: float


@dataclass
class EventTracker:
    """Decides which bus messages are worth a line, and writes them.

    Progress lines are per instance: a new phase prints at once, a progress change at most
    every ``progress_every_s``. A policy line waits (up to ``join_timeout_s``) for the
    learner's metrics of the same step, which it publishes just after the announcement.
    A message that does not decode is counted and logged, never raised.
    """

    printer: EventPrinter
    progress_every_s: float = 5.0
    join_timeout_s: float = 20.0
    monotonic: Callable[[], float] = time.monotonic
    bad_messages: int = field(default=0, init=False)
    _shown: dict[tuple[str, str], _Shown] = field(default_factory=dict, init=False)
    _metrics: dict[int, dict[str, float]] = field(default_factory=dict, init=False)
    _pending: dict[int, _PendingPolicy] = field(default_factory=dict, init=False)
    _recent_ids: dict[str, None] = field(default_factory=dict, init=False)  # insertion order

    def on_message(self, subject: str, data: bytes, message_id: str | None = None) -> None:
        """Print what one message says; a JetStream message whose id was just seen is a
        publish retried after a full stream (core subscribers see every try): skipped."""
        if message_id is not None:
            if message_id in self._recent_ids:
                return
            if len(self._recent_ids) >= RECENT_IDS:
                del self._recent_ids[next(iter(self._recent_ids))]  # the oldest
            self._recent_ids[message_id] = None
        try:
            self._dispatch(subject, data)
        except Exception as exc:
            self.bad_messages += 1
            log.warning("event watcher: skipped a message on %s: %s", subject, exc)

    def tick(self) -> None:
        """Print the policy lines whose metrics did not come in time."""
        now = self.monotonic()
        for step, pending in list(self._pending.items()):
            if now - pending.since >= self.join_timeout_s:
                self._print_policy(step)

    def _dispatch(self, subject: str, data: bytes) -> None:
        if subject.startswith(f"{HEARTBEATS}."):
            self._on_heartbeat(decode(data, Heartbeat))
        elif subject == LEARNER_METRICS:
            self._on_metric(decode(data, Metric))
        elif subject == POLICY_UPDATES:
            self._on_policy(decode(data, PolicyVersion))
        elif subject.startswith(f"{SIGNALS}."):
            signal = decode(data, Signal)
            self.printer.line(
                "signal_monitor",
                f"signal {signal.kind}  task {signal.task.id}  policy v{signal.policy_version}",
            )
        elif subject == VERDICTS:
            self._on_verdict(decode(data, Verdict))
        elif subject == TASK_ADDED:
            added = decode(data, TaskAdded)
            self.printer.line("pool_store", f"task added {added.task_id} ({added.origin})")
        elif subject.startswith(f"{DEAD_LETTERS}."):
            letter = decode(data, DeadLetter)
            reason = (letter.reason.splitlines() or [""])[0][:REASONS_CHARS]
            self.printer.line(letter.service, f"dead letter from {letter.subject}: {reason}")

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        key = (beat.service, beat.instance)
        shown = self._shown.get(key)
        now = self.monotonic()
        if shown is None and beat.phase == "starting":
            self._shown[key] = _Shown(beat.phase, beat.progress_done, now)
            return  # every service starts; a line says when it is running or what it does
        if shown is not None:
            if shown.phase == beat.phase and shown.done == beat.progress_done:
                return
            if shown.phase == beat.phase and now - shown.at < self.progress_every_s:
                return
        self._shown[key] = _Shown(beat.phase, beat.progress_done, now)
        back_from_step = shown is not None and shown.phase == GRPO_STEP_PHASE
        if beat.phase == GRPO_STEP_PHASE or (back_from_step and beat.phase == "running"):
            return  # a GRPO step has its own line, the policy it makes
        text = progress_text(beat.phase, beat.progress_done, beat.progress_total, beat.detail)
        self.printer.line(beat.service, text)

    def _on_metric(self, metric: Metric) -> None:
        if metric.name not in POLICY_METRICS:
            return
        self._metrics.setdefault(metric.step, {})[metric.name] = metric.value
        for old in sorted(self._metrics)[:-64]:  # steps whose announcement never came
            del self._metrics[old]
        if metric.step in self._pending and self._has_all_metrics(metric.step):
            self._print_policy(metric.step)

    def _on_policy(self, update: PolicyVersion) -> None:
        if update.step == 0:  # the warm start's weights: no GRPO step, no metrics
            self.printer.line("learner", f"policy v{update.version}  warm start")
            return
        self._pending[update.step] = _PendingPolicy(update, self.monotonic())
        if self._has_all_metrics(update.step):
            self._print_policy(update.step)

    def _has_all_metrics(self, step: int) -> bool:
        return POLICY_METRICS.keys() <= self._metrics.get(step, {}).keys()

    def _print_policy(self, step: int) -> None:
        update = self._pending.pop(step).update
        metrics = self._metrics.pop(step, {})
        parts = [f"policy v{update.version}"]
        for name, label in POLICY_METRICS.items():
            value = metrics.get(name)
            parts.append(f"{label} {_number(name, value)}")
        self.printer.line("learner", "  ".join(parts))

    def _on_verdict(self, verdict: Verdict) -> None:
        if verdict.accepted:
            self.printer.line("judge", f"accepted task {verdict.task.id}")
            return
        reasons = "; ".join(verdict.reasons)
        if len(reasons) > REASONS_CHARS:
            reasons = reasons[: REASONS_CHARS - 3] + "..."
        self.printer.line("judge", f"rejected task {verdict.task.id}: {reasons or 'no reason'}")


def _number(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name == "kl":
        return f"{value:.2g}"
    return f"{value:.1f}" if name == "staleness_mean" else f"{value:.2f}"


async def watch_events(
    url: str,
    tracker: EventTracker,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    poll_s: float = 0.2,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Feed ``tracker`` from the bus until ``should_stop()`` or cancellation.

    Waits for NATS if it is not up yet; once connected, nats-py reconnects (and
    re-subscribes) by itself when the server restarts. ``task_status.started()`` comes
    once the server has every subscription.
    """
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_when, should_stop, tg.cancel_scope, poll_s)
        bus = await _connect(url)
        try:
            with anyio.fail_after(NETWORK_TIMEOUT_S):
                subscriptions = [await bus.nc.subscribe(subject) for subject in WATCHED]
                await bus.nc.flush(timeout=int(NETWORK_TIMEOUT_S))
            for subscription in subscriptions:
                tg.start_soon(_pump, subscription, tracker)
            task_status.started()
            while True:
                await anyio.sleep(poll_s)
                tracker.tick()
        finally:
            with anyio.move_on_after(1.5, shield=True):
                await bus.close(timeout=1.0)


async def _cancel_when(
    should_stop: Callable[[], bool], scope: anyio.CancelScope, poll_s: float
) -> None:
    while not should_stop():
        await anyio.sleep(poll_s)
    scope.cancel()


async def _connect(url: str) -> Bus:
    """Connect, however long NATS takes to come up (cancel to give up)."""
    settings = BusSettings(url=url, connect_timeout_s=NETWORK_TIMEOUT_S)
    while True:
        try:
            return await Bus.connect(settings, name="coevolve-up-events")
        except BusError as exc:
            log.warning("event watcher: %s; retrying", exc)


async def _pump(subscription: Subscription, tracker: EventTracker) -> None:
    # the iterator, not next_msg(timeout): a message that arrives as next_msg times out is lost
    async for msg in subscription.messages:
        tracker.on_message(msg.subject, msg.data, (msg.headers or {}).get(MSG_ID_HEADER))


class EventWatcherThread:
    """``watch_events`` on its own event loop in a daemon thread, for the synchronous
    ``up``: ``start()``, then ``request_stop()`` (from a signal handler) and ``stop()``."""

    def __init__(self, url: str, tracker: EventTracker) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(url, tracker), name="coevolve-up-events", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, timeout_s: float = 3.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self, url: str, tracker: EventTracker) -> None:
        try:
            anyio.run(lambda: watch_events(url, tracker, should_stop=self._stop.is_set))
        except Exception:  # the watcher is a view: `up` goes on without it
            log.exception("event watcher stopped")
