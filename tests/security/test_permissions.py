"""Least privilege on the bus, against the real nats-server with authentication on.

The expectations here are written out by hand from the actor table (docs/security.md),
not derived from ``shared/runtime/permissions.py``: a permission that grows or shrinks there
without the design changing fails this matrix.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import nats
import pytest
from nats.aio.client import Client as NATS

from coevolve.shared.config import BusSettings, Settings
from coevolve.shared.messages import PolicyVersion, RolloutGroup, Task, Verdict, decode
from coevolve.shared.policy_sync import latest_policy, publish_policy
from coevolve.shared.runtime.bus import Bus, BusError, connect_options
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.permissions import ADMIN, USERS
from coevolve.shared.runtime.subjects import (
    CONSUMERS,
    HEARTBEAT_BUCKET,
    LEARNER_GROUPS_CONSUMER,
    POLICY_UPDATES,
    ROLLOUT_GROUPS,
    SERVICES,
    VERDICTS,
    stream_for,
)

pytestmark = pytest.mark.anyio

SERVICE_USERS = set(SERVICES)
POOL_ASKERS = {"learner", "signal_monitor", "explorer", "abstractor", "distiller", "reader"}

# subject -> the users (besides admin) that may publish to it
PUBLISH: dict[str, set[str]] = {
    "coevolve.rollout.jobs": {"pool_store"},
    "coevolve.rollout.groups": {"rollout"},
    "coevolve.rollout.results": {"rollout"},
    "coevolve.policy.updates": {"learner"},
    "coevolve.signals.zero_variance": {"signal_monitor"},
    "coevolve.explore.requests": {"operator", "explorer"},  # explorer: no-label discovery
    "coevolve.explorations": {"explorer"},
    "coevolve.candidates": {"abstractor"},
    "coevolve.verdicts": {"judge"},
    "coevolve.pool.task_added": {"pool_store"},
    "coevolve.experiences": {"distiller"},
    "coevolve.pool.rpc": POOL_ASKERS,
    "coevolve.pool.add": {"operator"},  # the read-only user cannot add tasks
    "coevolve.heartbeat.judge": {"judge"},
    "coevolve.metrics.learner": {"learner"},
    "coevolve.dlq.explorer": {"explorer"},
    "$KV.coevolve-heartbeats.rollout.instance": {"rollout"},
    "$O.coevolve-policy.C.chunk": {"learner"},
    "$O.coevolve-policy.M.meta": {"learner"},
    "$JS.API.STREAM.CREATE.OBJ_coevolve-policy": {"learner"},
    "$JS.API.STREAM.PURGE.OBJ_coevolve-policy": {"learner"},
    "$JS.API.STREAM.PURGE.COEVOLVE_VERDICTS": set(),
    "$JS.API.STREAM.DELETE.COEVOLVE_VERDICTS": set(),
    "$JS.API.STREAM.DELETE.OBJ_coevolve-policy": set(),
    "$JS.API.STREAM.UPDATE.COEVOLVE_ROLLOUT_JOBS": set(),
    # any writer may be the first to start: it creates (never changes) every stream
    "$JS.API.STREAM.CREATE.COEVOLVE_VERDICTS": SERVICE_USERS | {"operator"},
    "$JS.API.STREAM.INFO.COEVOLVE_VERDICTS": SERVICE_USERS | {"operator", "reader"},
    "$JS.API.CONSUMER.MSG.NEXT.COEVOLVE_ROLLOUT_GROUPS.learner": {"learner"},
    "$JS.API.CONSUMER.MSG.NEXT.COEVOLVE_ROLLOUT_GROUPS.signal_monitor": {"signal_monitor"},
    "$JS.API.CONSUMER.MSG.NEXT.COEVOLVE_VERDICTS.pool_store": {"pool_store"},
    "$JS.ACK.COEVOLVE_ROLLOUT_GROUPS.learner.1.1.1.1.0": {"learner"},
    "$JS.ACK.COEVOLVE_CANDIDATES.judge.1.1.1.1.0": {"judge"},
    # whoever creates the interest stream declares its readers (never reads through them)
    "$JS.API.CONSUMER.DURABLE.CREATE.COEVOLVE_ROLLOUT_GROUPS.learner": SERVICE_USERS | {"operator"},
    "$JS.API.CONSUMER.DURABLE.CREATE.COEVOLVE_VERDICTS.pool_store": {"pool_store"},
    "$JS.API.CONSUMER.DELETE.COEVOLVE_VERDICTS.pool_store": set(),
    "$JS.API.CONSUMER.INFO.COEVOLVE_ROLLOUT_GROUPS.learner": {"learner", "rollout", "reader"},
    "_INBOX.learner.reply": set(),  # replies come only from allow_responses
}

# subject -> the users (besides admin) that may subscribe to it
SUBSCRIBE: dict[str, set[str]] = {
    "coevolve.pool.rpc": {"pool_store"},
    "coevolve.pool.add": {"pool_store"},
    "coevolve.policy.updates": {"rollout", "evaluator", "reader"},
    "coevolve.signals.>": {"reader"},
    "coevolve.verdicts": {"reader"},
    "coevolve.heartbeat.>": {"reader"},
    # trajectories: through the durables, and to the distiller, which holds none
    "coevolve.rollout.groups": {"distiller"},
    "coevolve.experiences": set(),  # pool-store reads them through its durable
    "coevolve.rollout.jobs": set(),
    "coevolve.candidates": set(),
    "_INBOX.>": set(),
    "_INBOX.learner.x": {"learner"},
    "_INBOX.rollout.x": {"rollout"},
    ">": set(),
}


class Probe:
    """A raw connection as one user that records every permission violation."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.nc: NATS | None = None

    async def connect(self, settings: BusSettings, user: str) -> Probe:
        _, options = connect_options(settings, user)

        async def on_error(exc: Exception) -> None:
            self.violations.append(str(exc).lower())

        self.nc = await nats.connect(
            servers=[settings.url], name=f"probe-{user}", error_cb=on_error, **options
        )
        return self

    async def refusals(self, attempts: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Try every (action, subject); the ones the server refused. Violations are
        matched by subject: the server may report one after a later PONG."""
        assert self.nc is not None
        for action, subject in attempts:
            if action == "pub":
                await self.nc.publish(subject, b"{}")
            else:
                await self.nc.subscribe(subject)
        await self.nc.flush(timeout=5)
        await anyio.sleep(0.2)
        await self.nc.flush(timeout=5)
        words = {"pub": "publish to", "sub": "subscription to"}
        return {
            (action, subject)
            for action, subject in attempts
            if any(f'{words[action]} "{subject.lower()}"' in v for v in self.violations)
        }


def expected_allowed(users: set[str], user: str) -> bool:
    return user == ADMIN or user in users


async def test_every_user_may_publish_and_subscribe_exactly_as_designed(
    settings: Settings,
) -> None:
    assert set(USERS) == SERVICE_USERS | {"admin", "reader", "operator"}
    attempts = [("pub", subject) for subject in PUBLISH]
    attempts += [("sub", subject) for subject in SUBSCRIBE]
    wrong: list[str] = []
    for user in USERS:
        probe = await Probe().connect(settings.bus, user)
        assert probe.nc is not None
        try:
            refused = await probe.refusals(attempts)
        finally:
            await probe.nc.close()
        for action, subject in attempts:
            allowed = (PUBLISH if action == "pub" else SUBSCRIBE)[subject]
            if ((action, subject) in refused) == expected_allowed(allowed, user):
                verdict = "refused" if (action, subject) in refused else "allowed"
                wrong.append(f"{user} {action} {subject}: {verdict}")
    assert not wrong, "\n".join(wrong)


def server_log_lines(server: NatsServer, needle: str, timeout_s: float = 30.0) -> list[str]:
    """The server's log lines with ``needle``, once there are some or ``timeout_s`` passed."""
    assert server.log_file is not None
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in server.log_file.read_text().splitlines() if needle in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def quick(settings: Settings) -> BusSettings:
    """Bus settings whose refused requests (no reply ever comes) fail fast."""
    bus = settings.bus
    return BusSettings(
        url=bus.url,
        credentials_dir=bus.credentials_dir,
        request_timeout_s=0.5,
        publish_timeout_s=0.5,
    )


@contextlib.asynccontextmanager
async def learner_and_rollout(
    settings: Settings, fail_fast: bool = True
) -> AsyncIterator[tuple[Bus, Bus]]:
    """The learner and a rollout worker connected as their own users (``fail_fast``: the
    worker's refused requests fail fast, see :func:`quick`)."""
    learner = await Bus.connect(settings.bus, "learner", user="learner")
    rollout_bus = quick(settings) if fail_fast else settings.bus
    rollout = await Bus.connect(rollout_bus, "rollout", user="rollout")
    try:
        yield learner, rollout
    finally:
        await rollout.close()
        await learner.close()


async def test_rollout_can_neither_publish_a_policy_version_nor_a_verdict(
    settings: Settings, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = await Bus.connect(settings.bus, "test")  # the tests' own user
    try:
        async with learner_and_rollout(settings) as (learner, rollout):
            await admin.ensure_streams()  # every stream exists: only permissions can refuse
            good = await publish_policy(
                learner, b"learned", version=1, step=1, base_model="m", kind="lora"
            )
            with caplog.at_level(logging.ERROR, logger="coevolve.shared.runtime.bus"):
                with pytest.raises(nats.errors.TimeoutError):  # a refused publish: no reply
                    await publish_policy(
                        rollout, b"forged", version=9, step=9, base_model="m", kind="lora"
                    )
                with pytest.raises(nats.errors.TimeoutError):
                    await rollout.publish(POLICY_UPDATES, good)
                task = Task(
                    id="forged", environment="bfcl", user_turns=["hi"], origin="synthesized"
                )
                verdict = Verdict(candidate_id="c1", accepted=True, reasons=[], task=task)
                with pytest.raises(nats.errors.TimeoutError):
                    await rollout.publish(VERDICTS, verdict)
            # the rollout worker's log says what was refused ...
            refused = [r.getMessage() for r in caplog.records if "nats refused" in r.getMessage()]
            assert any('"$o.coevolve-policy.' in line for line in refused), (
                refused
            )  # nats-py lowercases
            assert any(f'"{VERDICTS}"' in line for line in refused), refused
            # ... so does the server's, with the user
            assert server_log_lines(
                nats_server, f'"$G/user:rollout" - Publish Violation - Subject "{VERDICTS}"'
            )
            assert server_log_lines(
                nats_server, 'user:rollout" - Publish Violation - Subject "$O.coevolve-policy.'
            )
            # and the announced policy is still the learner's
            announced = await latest_policy(learner)
            assert announced is not None and announced.sha256 == good.sha256
            verdicts = await admin.js.stream_info(stream_for(VERDICTS).name)
            assert verdicts.state.messages == 0
    finally:
        await admin.close()


async def test_a_service_cannot_read_another_services_durable_nor_delete_a_stream(
    settings: Settings,
) -> None:
    async with learner_and_rollout(settings) as (learner, rollout):
        await rollout.ensure_streams()  # declares the learner's durable on the interest stream
        group = RolloutGroup(
            id="g1", task_id="t1", origin="seed", policy_version=0, trajectories=[], job_id="j1"
        )
        await rollout.publish(ROLLOUT_GROUPS, group)
        spec = LEARNER_GROUPS_CONSUMER
        stolen = await rollout.js.pull_subscribe_bind(spec.durable, stream=spec.stream)
        with pytest.raises(nats.errors.TimeoutError):
            await stolen.fetch(1, timeout=0.5)
        with pytest.raises(nats.errors.TimeoutError):
            await rollout.js.delete_stream(spec.stream)
        with pytest.raises(nats.errors.TimeoutError):
            await rollout.js.delete_consumer(spec.stream, spec.durable)
        # the learner still gets its group: nothing was taken, deleted or acked
        own = await learner.ensure_consumer(spec)
        (msg,) = await own.fetch(1, timeout=5)
        assert decode(msg.data, RolloutGroup).id == "g1"
        await msg.ack_sync()


async def test_each_service_sets_itself_up_without_a_single_refusal(
    settings: Settings, nats_server: NatsServer
) -> None:
    """What every actor does at start (streams, its consumers, heartbeats), and what the
    read-only CLI does, all as their own users: the server refuses nothing."""
    for service in SERVICES:
        bus = await Bus.connect(settings.bus, service, user=service)
        try:
            await bus.ensure_streams()
            kv = await bus.js.create_key_value(bucket=HEARTBEAT_BUCKET, ttl=30)
            await kv.put(f"{service}.i1", b"{}")
            for spec in CONSUMERS:
                if spec.durable == service:
                    await bus.ensure_consumer(spec)
        finally:
            await bus.close()
    from coevolve.cli.status import collect

    reader = await Bus.connect(settings.bus, "coevolve-status", user="reader")
    try:
        status = await collect(reader, stale_after_s=5.0)
        assert {c["consumer"] for c in status["consumers"]} == {c.durable for c in CONSUMERS}
    finally:
        await reader.close()
    assert not server_log_lines(nats_server, "Violation", timeout_s=0.2)


async def test_rollout_reads_the_weights_the_learner_wrote(settings: Settings) -> None:
    from coevolve.shared.policy_sync import fetch_policy

    async with learner_and_rollout(settings, fail_fast=False) as (learner, rollout):
        await learner.ensure_streams()
        update = await publish_policy(
            learner, b"w" * 300_000, version=1, step=1, base_model="m", kind="lora"
        )
        announced = await latest_policy(rollout)
        assert isinstance(announced, PolicyVersion) and announced.version == 1
        assert await fetch_policy(rollout, update) == b"w" * 300_000


async def test_the_learner_may_prune_old_weights_and_rollout_may_not(
    settings: Settings, nats_server: NatsServer
) -> None:
    from coevolve.shared.policy_sync import policy_bucket, prune_policies

    async with learner_and_rollout(settings) as (learner, rollout):
        await learner.ensure_streams()
        for version in (1, 2, 3):
            await publish_policy(
                learner, b"w" * 1000, version=version, step=version, base_model="m", kind="lora"
            )
        assert await prune_policies(await policy_bucket(rollout), "target", newest=3, keep=1) == []
        pruned = await prune_policies(await policy_bucket(learner), "target", newest=3, keep=1)
        assert sorted(pruned) == ["policy-v00000001", "policy-v00000002"]
        names = [info.name for info in await (await policy_bucket(rollout)).list(True)]
        assert names == ["policy-v00000003"]


async def test_a_connection_without_valid_credentials_is_refused(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("COEVOLVE_NATS_CREDS_DIR")
    anonymous = BusSettings(url=nats_server.url, connect_timeout_s=60.0)
    started = anyio.current_time()
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(anonymous, "anonymous")
    # refused at once: not retried until its connect timeout
    assert anyio.current_time() - started < anonymous.connect_timeout_s
    forged = tmp_path / "forged.json"
    forged.write_text('{"user": "rollout", "password": "guessed"}')
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(BusSettings(url=nats_server.url, credentials=str(forged)), "forged")
    assert server_log_lines(nats_server, 'authentication error - User "rollout"')
