"""The NATS connection every actor uses: streams, consumers, publish, request/reply.

Every network await here has a timeout. Publishing to JetStream sets ``Nats-Msg-Id`` to
the message's id, so a re-publish after a crash is dropped by the server's duplicate
window; it also injects the current trace context into the headers.

A connection authenticates as its user (``shared/runtime/credentials.py`` finds the file) and
gets that user's permissions (``shared/runtime/permissions.py``); its inboxes live under
``_INBOX.<user>``, the only inboxes it may read. A refused publish or subscription is
logged at ERROR (the server logs it too).
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from coevolve.shared.config import BusSettings, BusTls
from coevolve.shared.messages import DecodeError, Message, decode, encode
from coevolve.shared.runtime.backoff import Backoff
from coevolve.shared.runtime.credentials import resolve
from coevolve.shared.runtime.permissions import (
    ADMIN,
    inbox_prefix,
    may_create_stream,
    may_declare_consumer,
    may_update_streams,
)
from coevolve.shared.runtime.subjects import (
    CONSUMERS,
    STREAM_BY_NAME,
    STREAMS,
    ConsumerSpec,
    StreamSpec,
)
from coevolve.shared.runtime.telemetry import inject

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)
M = TypeVar("M", bound=Message)

MSG_ID_HEADER = "Nats-Msg-Id"
_STREAM_FULL_CODES = {10077, 10047, 10078}  # max msgs / max bytes / storage exceeded
_STREAM_NAME_IN_USE = 10058  # the stream exists with another configuration
_RETENTION = {
    "limits": RetentionPolicy.LIMITS,
    "workqueue": RetentionPolicy.WORK_QUEUE,
    "interest": RetentionPolicy.INTEREST,
}


class BusError(RuntimeError):
    pass


class StreamUnavailableError(nats.errors.TimeoutError):
    """JetStream did not take a message: no server answered for its stream (on a cluster:
    no node leads it, usually because fewer than half of the nodes are up). A timeout, so
    the handlers of timeouts keep handling it; its text says what it likely means."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


# what JetStream answers while no node leads a stream (a cluster electing a leader, or
# one without quorum); a publish may also just time out
NO_LEADER = (ServiceUnavailableError, NoStreamResponseError)
UNAVAILABLE = (nats.errors.TimeoutError, *NO_LEADER)


def leaderless_hint(exc: BaseException) -> str:
    """What a JetStream 'unavailable' error usually means, for a log line ('' otherwise)."""
    if isinstance(exc, NO_LEADER):
        return (
            " (no NATS node leads this stream right now: a cluster electing a leader, or one "
            "that has lost quorum; it resumes without loss once enough nodes are back)"
        )
    return ""


def unavailable_reason(subject: str, settings: BusSettings) -> str:
    nodes = len(server_urls(settings.url))
    if nodes > 1:
        return (
            f"{subject}: no node of the NATS cluster leads its stream; the cluster has "
            f"probably lost quorum (fewer than {nodes // 2 + 1} of its {nodes} nodes up). "
            "Retrying: work resumes without loss once enough nodes are back"
        )
    return f"{subject}: the NATS server did not store the message in time; retrying"


class BackpressureError(BusError):
    """A bounded stream stayed full for the whole publish timeout."""


def server_urls(url: str) -> list[str]:
    """``bus.url`` as the client's server list (a cluster's nodes are comma-separated)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def stream_config(spec: StreamSpec, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        num_replicas=replicas,
        name=spec.name,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        max_msgs=spec.max_msgs,
        max_bytes=spec.max_bytes,
        max_age=spec.max_age_s or None,
        discard=DiscardPolicy.NEW if spec.discard_new else DiscardPolicy.OLD,
        storage=StorageType.FILE,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=8 * 1024 * 1024,
    )


def consumer_config(spec: ConsumerSpec) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
    )


def tls_context(tls: BusTls) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.ca)
    if tls.cert:
        context.load_cert_chain(tls.cert, tls.key)
    return context


def connect_options(settings: BusSettings, user: str | None) -> tuple[str | None, dict[str, Any]]:
    """The authenticated user (None: no authentication) and its nats-py connect options."""
    options: dict[str, Any] = {}
    creds = resolve(settings, user)
    if creds is not None:
        options.update(user=creds.user, password=creds.password)
        options["inbox_prefix"] = inbox_prefix(creds.user)
    if settings.tls is not None:
        options["tls"] = tls_context(settings.tls)
    return (creds.user if creds else None), options


async def declare_streams(settings: BusSettings) -> None:
    """As the admin user: create every stream, or update one whose configuration changed
    (what `coevolve up` does before the services start)."""
    bus = await Bus.connect(settings, name="coevolve-setup", user=ADMIN)
    try:
        await bus.ensure_streams()
    finally:
        await bus.close()


def cancel_until_done(task: asyncio.Future[Any], every_s: float = 0.05) -> None:
    """Cancel ``task`` again every ``every_s`` until it ends, without awaiting it.

    One cancel is not enough for nats-py's first connect: Python 3.11's ``wait_for``
    returns a connect error that raced the cancel, and nats-py's server loop retries on
    that error forever, so an abandoned connect would outlive its caller's event loop.
    """
    if task.done():
        return
    task.cancel()
    asyncio.get_running_loop().call_later(every_s, cancel_until_done, task, every_s)


class Bus:
    def __init__(self, nc: NATS, settings: BusSettings, user: str | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=settings.request_timeout_s)
        self.settings = settings
        self.user = user

    @classmethod
    async def connect(cls, settings: BusSettings, name: str, user: str | None = None) -> Bus:
        """Connect as ``user`` (a service's name; None: the default user), retrying until
        ``connect_timeout_s`` passes; reconnect forever after. Refused credentials fail
        at once."""
        authenticated, options = connect_options(settings, user)
        refused = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            text = str(exc).lower()
            if "authorization violation" in text:
                refused.set()
            if "permissions violation" in text or "authorization violation" in text:
                log.error("nats refused %s (user %s): %s", name, authenticated, exc)
            else:
                log.debug("nats error: %s", exc)

        async def on_disconnect() -> None:
            log.info("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected")

        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.connect_timeout_s
        while True:
            # the client would retry an unreachable server forever: bound the first connect
            connecting = asyncio.ensure_future(
                nats.connect(
                    servers=server_urls(settings.url),
                    name=name,
                    connect_timeout=min(2.0, settings.connect_timeout_s),
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    **options,
                )
            )
            refusal = asyncio.ensure_future(refused.wait())
            try:
                await asyncio.wait(
                    {connecting, refusal},
                    timeout=max(0.1, deadline - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            except BaseException:
                cancel_until_done(connecting)
                raise
            finally:
                refusal.cancel()
            if refused.is_set():
                cancel_until_done(connecting)
                raise BusError(
                    f"NATS at {settings.url} refused the credentials of {authenticated!r} "
                    "(authorization violation)"
                )
            try:
                if not connecting.done():
                    cancel_until_done(connecting)
                    raise TimeoutError
                return cls(connecting.result(), settings, authenticated)
            except (OSError, nats.errors.Error, TimeoutError) as exc:
                if loop.time() >= deadline:
                    raise BusError(f"cannot reach NATS at {settings.url}: {exc!r}") from exc
                await asyncio.sleep(0.2)

    async def ensure_streams(self, specs: tuple[StreamSpec, ...] = STREAMS) -> None:
        """Declare the streams this user works with; safe from every service at every
        start. Creation is idempotent; only an unrestricted user (admin) updates a stream
        whose configuration changed, the others log it and carry on."""
        specs = tuple(spec for spec in specs if may_create_stream(self.user, spec.name))
        for spec in specs:
            config = stream_config(spec, self.settings.replicas)
            try:
                await self.js.add_stream(config)
            except APIError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                if may_update_streams(self.user):
                    await self.js.update_stream(config)
                else:
                    log.warning(
                        "stream %s differs from this version's configuration; "
                        "`coevolve up` (the admin user) updates it",
                        spec.name,
                    )
        # An interest stream drops what no consumer is interested in yet: declare its
        # consumers with the stream, so start-up order cannot lose a rollout group.
        names = {spec.name for spec in specs}
        for consumer in CONSUMERS:
            if (
                consumer.stream in names
                and STREAM_BY_NAME[consumer.stream].retention == "interest"
                and may_declare_consumer(self.user, consumer)
            ):
                await self.js.add_consumer(consumer.stream, consumer_config(consumer))

    async def ensure_consumer(self, spec: ConsumerSpec) -> JetStreamContext.PullSubscription:
        await self.js.add_consumer(spec.stream, consumer_config(spec))
        return await self.js.pull_subscribe_bind(spec.durable, stream=spec.stream)

    async def publish(
        self, subject: str, message: Message, headers: dict[str, str] | None = None
    ) -> PubAck:
        """Publish to JetStream; wait while a bounded stream is full (backpressure)."""
        headers = inject({**(headers or {}), MSG_ID_HEADER: message.id})
        payload = encode(message)
        timeout = self.settings.publish_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                return await self.js.publish(subject, payload, timeout=timeout, headers=headers)
            except UNAVAILABLE as exc:
                raise StreamUnavailableError(unavailable_reason(subject, self.settings)) from exc
            except APIError as exc:
                if exc.err_code not in _STREAM_FULL_CODES:
                    raise
                delay = backoff.next_delay()
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise BackpressureError(f"{subject}: stream full for {timeout} s") from exc
                await asyncio.sleep(delay)

    async def follow(self, subject: str, kind: type[M], on_message: Callable[[M], None]) -> None:
        """Hand every ``kind`` message published on ``subject`` to ``on_message``, on a
        core subscription (it holds none of a stream's messages), until cancelled; one
        that does not decode is logged and skipped."""
        sub = await self.nc.subscribe(subject)
        try:
            # the iterator, not next_msg(timeout), which can lose a message as it times out
            async for msg in sub.messages:
                try:
                    message = decode(msg.data, kind)
                except DecodeError as exc:
                    log.warning("ignored a message on %s that does not decode: %s", subject, exc)
                    continue
                on_message(message)
        finally:
            with anyio.move_on_after(2, shield=True):
                await sub.unsubscribe()

    async def publish_core(self, subject: str, message: Message) -> None:
        """Fire-and-forget core NATS publish (heartbeats, live views)."""
        await self.nc.publish(subject, encode(message), headers=inject({}))

    async def request(
        self, subject: str, message: Message, reply_type: type[R], timeout: float | None = None
    ) -> R:
        reply = await self.nc.request(
            subject,
            encode(message),
            timeout=timeout or self.settings.request_timeout_s,
            headers=inject({}),
        )
        return decode(reply.data, reply_type)

    async def close(self, timeout: float = 5.0) -> None:
        """Flush what was published, then close.

        Not ``drain``: messages a pull subscription fetched and nobody handles any more
        held it for its whole timeout and left an asyncio error in every service's log at
        every stop; unacked, JetStream redelivers them anyway.
        """
        if self.nc.is_closed:
            return
        try:
            await self.nc.flush(max(1, math.ceil(timeout)))  # the client takes whole seconds
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("nats flush before close failed: %r", exc)
        await self.nc.close()
