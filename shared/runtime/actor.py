"""The actor runtime: what every service is, and how it is run.

An actor declares what it consumes (durable JetStream pull consumers shared by all its
replicas: work-queue delivery), what it answers (request/reply on core NATS, queue group
per service) and its background loops. ``ActorRunner`` does the rest:

- a message is acked only after its handler returned (the effect is committed);
- a message whose bytes do not decode, or that breaks the catalogue's constraints
  (``messages.decode``: bounds, finite floats, ``validate()``), goes to
  ``coevolve.dlq.<service>`` with the reason, and the service keeps running; so does one
  the handler refuses (``Rejected``) and one that failed ``max_deliver`` times;
- a handler that raises gets the message back later (nak with back-off);
- a message already processed by this instance (same ``Nats-Msg-Id``) is acked without
  running the handler again (durable idempotency is the handler's, e.g. pool-store's);
- long handlers keep their message with ``in_progress`` so it is not redelivered;
- heartbeats go to the ``coevolve-heartbeats`` key-value bucket and a core subject,
  with the phase and progress the service reports (``Actor.report_progress``);
- SIGTERM/SIGINT: stop fetching, let in-flight work finish for ``drain_timeout_s``, nak
  what is still running, drain the connection, return (exit 0);
- a background loop that raises ``ServiceFailed`` ends the service with that error.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

import anyio
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from coevolve.shared.config import Settings
from coevolve.shared.messages import (
    DeadLetter,
    DecodeError,
    ErrorReply,
    Heartbeat,
    Message,
    Metric,
    decode,
    encode,
    new_id,
)
from coevolve.shared.runtime.backoff import Backoff
from coevolve.shared.runtime.bus import MSG_ID_HEADER, Bus, leaderless_hint
from coevolve.shared.runtime.subjects import (
    HEARTBEAT_BUCKET,
    ConsumerSpec,
    dead_letter_subject,
    heartbeat_subject,
    metrics_subject,
)
from coevolve.shared.runtime.supervisor import mark_ready
from coevolve.shared.runtime.telemetry import extract, make_tracer_provider

log = logging.getLogger(__name__)

# After its drain a service tears down, closes its connection and exits, each within a limit;
# ``up`` waits for the sum (STOP_AFTER_DRAIN_S) before it kills one.
TEARDOWN_LIMIT_S = 1.5
BUS_CLOSE_LIMIT_S = 1.5
EXIT_GRACE_S = 3.0  # from "stopped" to the process's end (``end_process_after``)
STOP_AFTER_DRAIN_S = TEARDOWN_LIMIT_S + BUS_CLOSE_LIMIT_S + EXIT_GRACE_S

M = TypeVar("M", bound=Message)

NETWORK_TIMEOUT_S = 5.0


class Rejected(Exception):
    """Raised by a handler for a well-formed message it can never process (a task id
    nobody knows): the runtime dead-letters it at once with this reason, no retries."""


class ServiceFailed(RuntimeError):
    """Raised by a background loop when the service cannot go on (a learner rank died):
    the service exits with an error instead of restarting the loop, and its supervisor
    restarts it."""


@dataclass(frozen=True)
class Delivery:
    """What a handler may want to know about the message it is handling."""

    subject: str
    headers: dict[str, str]
    num_delivered: int
    message_id: str


@dataclass(frozen=True)
class Progress:
    """What a service reports it is doing (sent with its heartbeats)."""

    phase: str
    done: int | None = None
    total: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Consumer(Generic[M]):
    spec: ConsumerSpec
    message: type[M]
    handler: Callable[[M, Delivery], Awaitable[None]]
    concurrency: int = 1


@dataclass(frozen=True)
class Responder:
    """Answers requests on ``subject``; ``request`` is a message type or a tagged union."""

    subject: str
    request: Any
    handler: Callable[[Any], Awaitable[Message]]
    concurrency: int = 4


class Actor:
    """Base class of every service. Subclasses set ``name`` and override what they need."""

    name: ClassVar[str]
    # how long setup() may take (loading a model, a warm start) before the service fails
    setup_timeout_s: ClassVar[float] = 300.0
    # replaced whole (never mutated), so a worker thread can report while heartbeats read
    _progress: Progress | None = None

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._bus: Bus | None = None
        self._tracer: Tracer | None = None

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError(f"{self.name}: bus used before the actor was started")
        return self._bus

    @property
    def tracer(self) -> Tracer:
        if self._tracer is None:
            raise RuntimeError(f"{self.name}: tracer used before the actor was started")
        return self._tracer

    def consumers(self) -> Sequence[Consumer[Any]]:
        return ()

    def responders(self) -> Sequence[Responder]:
        return ()

    def loops(self) -> Sequence[Callable[[], Awaitable[None]]]:
        """Background coroutines that run until shutdown cancels them."""
        return ()

    async def setup(self) -> None:
        """Runs once connected, before any message is taken."""

    async def teardown(self) -> None:
        """Runs after the last handler finished or was cancelled."""

    async def publish(self, subject: str, message: Message) -> None:
        await self.bus.publish(subject, message)

    async def metric(self, name: str, value: float, step: int = 0, **tags: str) -> None:
        metric = Metric(service=self.name, name=name, value=value, step=step, tags=tags)
        await self.bus.publish_core(metrics_subject(self.name), metric)

    def report_progress(
        self, phase: str, done: int | None = None, total: int | None = None, detail: str = ""
    ) -> None:
        """Say what this service is doing, e.g. ``("warm start", 7, 16)``; the next
        heartbeat carries it to ``coevolve status`` and ``coevolve up``. Cheap, and safe
        from any thread (one attribute assignment). What is reported during ``setup()``
        is cleared when setup ends and the phase becomes "running"."""
        self._progress = Progress(phase, done, total, detail)

    def clear_progress(self) -> None:
        """Back to the runner's own phase ("starting" or "running")."""
        self._progress = None


@dataclass
class RunnerStats:
    processed: int = 0
    failed: int = 0
    dead_lettered: int = 0
    in_flight: int = 0


class _SeenIds:
    """A bounded LRU of message ids this instance has already acked."""

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, message_id: str) -> bool:
        return message_id in self._ids

    def add(self, message_id: str) -> None:
        self._ids[message_id] = None
        self._ids.move_to_end(message_id)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)


class ActorRunner:
    def __init__(self, actor: Actor, instance: str | None = None) -> None:
        self.actor = actor
        self.settings = actor.settings
        self.instance = instance or new_id()[:12]
        self.stats = RunnerStats()
        self.started_at = time.time()
        self.phase: Literal["starting", "running"] = "starting"
        self._stopping = anyio.Event()
        self._drained = anyio.Event()
        self._seen = _SeenIds(self.settings.runtime.idempotency_cache)
        self._provider = make_tracer_provider(actor.name, self.instance, self.settings)
        self._tracer = self._provider.get_tracer(f"coevolve.{actor.name}")

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self, *, handle_signals: bool = True) -> None:
        name = self.actor.name
        bus = await Bus.connect(self.settings.bus, name=f"{name}-{self.instance}", user=name)
        try:
            with anyio.fail_after(30):
                await bus.ensure_streams()
                kv = await bus.js.create_key_value(
                    bucket=HEARTBEAT_BUCKET,
                    ttl=self.settings.runtime.heartbeat_ttl_s,
                    replicas=self.settings.bus.replicas,
                )
            self.actor._bus, self.actor._tracer = bus, self._tracer
            async with anyio.create_task_group() as tg:
                if handle_signals:
                    tg.start_soon(self._watch_signals)
                # heartbeats start before setup: loading a model or a warm start can take
                # minutes, and status should show the service as starting, not missing
                tg.start_soon(self._heartbeats, bus, kv)
                tg.start_soon(self._start_work, bus, tg)
                await self._stopping.wait()
                log.info("%s %s draining (%d in flight)", name, self.instance, self.stats.in_flight)
                with anyio.move_on_after(self.settings.runtime.drain_timeout_s):
                    if self.stats.in_flight:
                        await self._drained.wait()
                tg.cancel_scope.cancel()
            with anyio.move_on_after(TEARDOWN_LIMIT_S, shield=True):
                await self.actor.teardown()
                await kv.delete(self._heartbeat_key())
        finally:
            with anyio.move_on_after(BUS_CLOSE_LIMIT_S, shield=True):
                await bus.close(timeout=1.0)
            self._provider.shutdown()
            log.info("%s %s stopped", name, self.instance)

    async def _start_work(self, bus: Bus, tg: anyio.abc.TaskGroup) -> None:
        name = self.actor.name
        with anyio.fail_after(self.actor.setup_timeout_s):
            await self.actor.setup()
        self.actor.clear_progress()
        with anyio.fail_after(NETWORK_TIMEOUT_S * 2):
            pulls = [(c, await bus.ensure_consumer(c.spec)) for c in self.actor.consumers()]
            subs = [
                (r, await bus.nc.subscribe(r.subject, queue=name)) for r in self.actor.responders()
            ]
        self.phase = "running"
        mark_ready()  # a supervisor resets this service's restart back-off
        log.info("%s %s started", name, self.instance)
        for consumer, pull in pulls:
            tg.start_soon(self._consume, bus, consumer, pull, tg)
        for responder, sub in subs:
            tg.start_soon(self._respond, bus, responder, sub, tg)
        for loop in self.actor.loops():
            tg.start_soon(self._guarded_loop, loop)

    # ------------------------------------------------------------------ loops

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                self.request_stop()
                return

    def _heartbeat_key(self) -> str:
        return f"{self.actor.name}.{self.instance}"

    async def _heartbeats(self, bus: Bus, kv: KeyValue) -> None:
        interval = self.settings.runtime.heartbeat_interval_s
        host = socket.gethostname()
        while True:
            progress = self.actor._progress  # read once: a worker thread may replace it
            beat = Heartbeat(
                service=self.actor.name,
                instance=self.instance,
                pid=os.getpid(),
                host=host,
                started_at=self.started_at,
                phase=progress.phase if progress else self.phase,
                in_flight=self.stats.in_flight,
                processed=self.stats.processed,
                failed=self.stats.failed,
                dead_lettered=self.stats.dead_lettered,
                progress_done=progress.done if progress else None,
                progress_total=progress.total if progress else None,
                detail=progress.detail if progress else "",
            )
            try:
                with anyio.fail_after(NETWORK_TIMEOUT_S):
                    await kv.put(self._heartbeat_key(), encode(beat))
                    await bus.publish_core(heartbeat_subject(self.actor.name), beat)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("heartbeat failed: %s%s", exc, leaderless_hint(exc))
            await anyio.sleep(interval)

    async def _guarded_loop(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Restart a background loop that crashed, with back-off, until shutdown."""
        backoff = Backoff(first_s=1.0, longest_s=30.0)
        while not self._stopping.is_set():
            try:
                await loop()
                return
            except ServiceFailed:
                raise
            except Exception:
                log.exception("%s: background loop %s crashed", self.actor.name, loop)
                await anyio.sleep(backoff.next_delay())

    async def _consume(
        self,
        bus: Bus,
        consumer: Consumer[Any],
        pull: JetStreamContext.PullSubscription,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        slots = anyio.Semaphore(consumer.concurrency)
        fetch_timeout = self.settings.runtime.fetch_timeout_s
        while not self._stopping.is_set():
            await slots.acquire()
            batch = 1
            while batch < consumer.concurrency and slots.value > 0:
                slots.acquire_nowait()
                batch += 1
            try:
                msgs = await pull.fetch(batch=batch, timeout=fetch_timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                msgs = []
            except nats.errors.Error as exc:
                log.warning(
                    "%s fetch failed: %s%s", consumer.spec.durable, exc, leaderless_hint(exc)
                )
                msgs = []
                await anyio.sleep(fetch_timeout)
            for _ in range(batch - len(msgs)):
                slots.release()
            for msg in msgs:
                if self._stopping.is_set():
                    await _settle(msg.nak())
                    slots.release()
                    continue
                self._enter()
                tg.start_soon(self._handle_jetstream, bus, consumer, msg, slots)

    async def _respond(
        self, bus: Bus, responder: Responder, sub: Subscription, tg: anyio.abc.TaskGroup
    ) -> None:
        slots = anyio.Semaphore(responder.concurrency)
        # the iterator, not next_msg(timeout), which can lose a message as it times out; the
        # task is cancelled once the drain ends
        async for msg in sub.messages:
            if self._stopping.is_set():
                return
            await slots.acquire()
            self._enter()
            tg.start_soon(self._handle_request, bus, responder, msg, slots)

    # ------------------------------------------------------------------ handling

    def _enter(self) -> None:
        self.stats.in_flight += 1

    def _leave(self) -> None:
        self.stats.in_flight -= 1
        if self.stats.in_flight == 0 and self._stopping.is_set():
            self._drained.set()

    async def _handle_jetstream(
        self, bus: Bus, consumer: Consumer[Any], msg: Msg, slots: anyio.Semaphore
    ) -> None:
        headers = dict(msg.headers or {})
        delivered = msg.metadata.num_delivered or 1
        try:
            with self._tracer.start_as_current_span(
                f"{self.actor.name} process {msg.subject}",
                context=extract(headers),
                kind=SpanKind.CONSUMER,
                attributes={
                    "messaging.system": "nats",
                    "messaging.destination.name": msg.subject,
                    "messaging.message.id": headers.get(MSG_ID_HEADER, ""),
                    "coevolve.delivery": delivered,
                },
            ) as span:
                try:
                    message = decode(msg.data, consumer.message)
                except DecodeError as exc:
                    await self._dead_letter(bus, msg, headers, str(exc))
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    return
                message_id = headers.get(MSG_ID_HEADER) or message.id
                if message_id in self._seen:
                    await _settle(msg.ack_sync(timeout=NETWORK_TIMEOUT_S))
                    return
                delivery = Delivery(msg.subject, headers, delivered, message_id)
                try:
                    await self._run_keeping_alive(consumer, message, delivery, msg)
                except anyio.get_cancelled_exc_class():
                    with anyio.move_on_after(1.0, shield=True):
                        await _settle(msg.nak())
                    raise
                except Rejected as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    await self._dead_letter(bus, msg, headers, f"rejected: {exc}")
                    return
                except Exception as exc:
                    self.stats.failed += 1
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, repr(exc)))
                    if delivered >= consumer.spec.max_deliver:
                        reason = f"handler failed {delivered} times: {traceback.format_exc()}"
                        await self._dead_letter(bus, msg, headers, reason)
                    else:
                        log.warning("%s: handler failed (%r); redelivering", msg.subject, exc)
                        await _settle(msg.nak(delay=min(2.0**delivered, 60.0)))
                    return
                await _settle(msg.ack_sync(timeout=NETWORK_TIMEOUT_S))
                self._seen.add(message_id)
                self.stats.processed += 1
        finally:
            self._leave()
            slots.release()

    async def _run_keeping_alive(
        self, consumer: Consumer[Any], message: Message, delivery: Delivery, msg: Msg
    ) -> None:
        async def keep_alive() -> None:
            period = max(consumer.spec.ack_wait_s / 3, 0.5)
            while True:
                await anyio.sleep(period)
                await _settle(msg.in_progress())

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_alive)
                await consumer.handler(message, delivery)
                tg.cancel_scope.cancel()
        except ExceptionGroup as group:  # the task group wraps what the handler raised
            rejected = [e for e in group.exceptions if isinstance(e, Rejected)]
            if rejected:
                raise rejected[0] from None
            raise

    async def _handle_request(
        self, bus: Bus, responder: Responder, msg: Msg, slots: anyio.Semaphore
    ) -> None:
        headers = dict(msg.headers or {})
        try:
            with self._tracer.start_as_current_span(
                f"{self.actor.name} answer {msg.subject}",
                context=extract(headers),
                kind=SpanKind.SERVER,
            ):
                try:
                    request = decode(msg.data, responder.request)
                except DecodeError as exc:
                    reply: Message = ErrorReply(error=str(exc))
                    await self._dead_letter(bus, msg, headers, str(exc))
                else:
                    try:
                        reply = await responder.handler(request)
                        self.stats.processed += 1
                    except Rejected as exc:
                        reply = ErrorReply(error=f"rejected: {exc}")
                        await self._dead_letter(bus, msg, headers, f"rejected: {exc}")
                    except Exception as exc:
                        log.exception("%s: request failed", msg.subject)
                        self.stats.failed += 1
                        reply = ErrorReply(error=f"{type(exc).__name__}: {exc}")
                if msg.reply:
                    await _settle(msg.respond(encode(reply)))
        finally:
            self._leave()
            slots.release()

    async def _dead_letter(self, bus: Bus, msg: Msg, headers: dict[str, str], reason: str) -> None:
        self.stats.dead_lettered += 1
        log.error("dead-lettering message on %s: %s", msg.subject, reason.splitlines()[0])
        letter = DeadLetter(
            service=self.actor.name,
            subject=msg.subject,
            reason=reason,
            payload=msg.data,
            headers=headers,
        )
        try:
            with anyio.fail_after(NETWORK_TIMEOUT_S * 2):
                await bus.publish(dead_letter_subject(self.actor.name), letter)
        except Exception as exc:  # never let a dead letter take the service down
            log.error("could not publish dead letter: %r", exc)
            return
        if (msg.reply or "").startswith("$JS.ACK."):
            await _settle(msg.term())


async def _settle(ack: Awaitable[object]) -> None:
    """Ack/nak/term with a timeout; a lost ack only means a redelivery later."""
    try:
        with anyio.fail_after(NETWORK_TIMEOUT_S):
            await ack
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("ack failed (message will be redelivered): %r", exc)


def run_actor(actor: Actor) -> None:
    """Run one actor in this process until SIGTERM/SIGINT (what ``coevolve serve`` does)."""
    logging.basicConfig(
        level=os.environ.get("COEVOLVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {actor.name} %(levelname)s %(name)s: %(message)s",
    )
    runner = ActorRunner(actor)

    async def serve() -> None:
        try:
            await runner.run()
        finally:
            end_process_after(EXIT_GRACE_S)

    anyio.run(serve)
    exit_past_abandoned_work()


def end_process_after(grace_s: float) -> None:
    """Past ``grace_s`` from now, write every thread's stack to stderr and end the process.

    What runs after the actor stopped (the event loop's close, which in Python 3.11 waits
    for its default executor without a limit; the interpreter's finalization) must not
    outlast the time ``up`` gives a stop: a stack in the service's log says what held it,
    where a kill says nothing. faulthandler's timer is a C thread, so it fires even while
    a native call holds the GIL; it exits with status 1.
    """
    faulthandler.dump_traceback_later(grace_s, exit=True, file=sys.stderr)


def exit_past_abandoned_work(grace_s: float = 0.5) -> None:
    """End the process now if a worker thread still runs work the stop abandoned.

    A generation or a training step cancelled at shutdown keeps its thread busy, and the
    interpreter would wait for it on exit (a learner step: a minute). Its result is not
    needed: its message was not acked (it is redelivered) and nothing was announced.
    """
    deadline = time.monotonic() + grace_s
    busy = _busy_threads()
    while busy and time.monotonic() < deadline:
        busy[0].join(timeout=max(0.0, deadline - time.monotonic()))
        busy = _busy_threads()
    if busy:
        log.warning("exiting past %d thread(s) busy with abandoned work", len(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _busy_threads() -> list[threading.Thread]:
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and t.is_alive() and not t.daemon]
