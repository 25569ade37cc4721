"""Policy weights over the bus: the learner puts them in the object store and announces
the version; rollout workers fetch, verify and hot-swap."""

from __future__ import annotations

import logging

import anyio
from nats.errors import Error as NatsError
from nats.js.api import ObjectStoreConfig
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import ObjectStore

from coevolve.shared.messages import Agent, PolicyVersion, decode, derived_id
from coevolve.shared.policy.weights import weights_digest
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import (
    FAILURE_POLICY_UPDATES,
    POLICY_BUCKET,
    POLICY_UPDATES,
)

TRANSFER_TIMEOUT_S = 120.0
PRUNE_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


class PolicySyncError(RuntimeError):
    pass


async def policy_bucket(bus: Bus) -> ObjectStore:
    with anyio.fail_after(10):
        try:
            return await bus.js.object_store(POLICY_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            return await bus.js.create_object_store(
                POLICY_BUCKET, config=ObjectStoreConfig(replicas=bus.settings.replicas)
            )


def _object_prefix(agent: Agent) -> str:
    return f"{'policy' if agent == 'target' else agent}-v"


def object_name(version: int, agent: Agent = "target") -> str:
    return f"{_object_prefix(agent)}{version:08d}"


def object_version(name: str, agent: Agent = "target") -> int | None:
    """The version of ``agent`` an object name holds (None: another agent's, or not one)."""
    prefix = _object_prefix(agent)
    digits = name.removeprefix(prefix)
    return int(digits) if name.startswith(prefix) and digits.isdigit() else None


def updates_subject(agent: Agent = "target") -> str:
    """Where ``agent``'s versions are announced."""
    return POLICY_UPDATES if agent == "target" else FAILURE_POLICY_UPDATES


async def publish_policy(
    bus: Bus,
    blob: bytes,
    *,
    version: int,
    step: int,
    base_model: str,
    kind: str,
    agent: Agent = "target",
    keep: int = 0,
) -> PolicyVersion:
    """Store the weights, then announce them (in that order: an announced version exists);
    then delete ``agent``'s objects older than its ``keep`` newest versions (0 keeps all)."""
    bucket = await policy_bucket(bus)
    name = object_name(version, agent)
    with anyio.fail_after(TRANSFER_TIMEOUT_S):
        await bucket.put(name, blob)
    digest = weights_digest(blob)
    update = PolicyVersion(
        # the digest is part of the id: the bus's de-duplication can never merge two
        # different sets of weights announced under one version number
        id=derived_id(
            "policy", base_model, version, digest, *([agent] if agent != "target" else [])
        ),
        version=version,
        step=step,
        bucket=POLICY_BUCKET,
        object_name=name,
        base_model=base_model,
        kind="full" if kind == "full" else "lora",
        sha256=digest,
    )
    await bus.publish(updates_subject(agent), update)
    if keep > 0:
        await prune_policies(bucket, agent, newest=version, keep=keep)
    return update


async def prune_policies(bucket: ObjectStore, agent: Agent, *, newest: int, keep: int) -> list[str]:
    """Delete ``agent``'s objects of versions up to ``newest - keep`` (each version is a
    full copy of the weights, and readers fetch only the newest); returns what it deleted.
    Housekeeping: a failure is logged, never raised."""
    deleted: list[str] = []
    try:
        with anyio.fail_after(PRUNE_TIMEOUT_S):
            try:
                objects = await bucket.list(ignore_deletes=True)
            except NotFoundError:
                return deleted
            for info in objects:
                version = object_version(info.name or "", agent)
                if version is not None and version <= newest - keep:
                    await bucket.delete(info.name)
                    deleted.append(info.name)
    except (NatsError, TimeoutError) as exc:
        log.warning("could not prune old %s policy versions from the bus: %r", agent, exc)
    if deleted:
        log.info("pruned %d old %s policy versions from the bus", len(deleted), agent)
    return deleted


async def fetch_policy(bus: Bus, update: PolicyVersion) -> bytes:
    bucket = await policy_bucket(bus)
    try:
        with anyio.fail_after(TRANSFER_TIMEOUT_S):
            result = await bucket.get(update.object_name)
    except NotFoundError as exc:
        raise PolicySyncError(
            f"{update.object_name}: no longer in the bus (a newer version replaced it)"
        ) from exc
    blob = bytes(result.data or b"")
    if weights_digest(blob) != update.sha256:
        raise PolicySyncError(f"{update.object_name}: sha256 mismatch, refusing the weights")
    return blob


async def latest_policy(bus: Bus, agent: Agent = "target") -> PolicyVersion | None:
    """``agent``'s newest announced version, or None before the first one."""
    from coevolve.shared.runtime.subjects import stream_for

    subject = updates_subject(agent)
    try:
        with anyio.fail_after(10):
            raw = await bus.js.get_last_msg(stream_for(subject).name, subject)
    except NotFoundError:
        return None
    return decode(raw.data or b"", PolicyVersion)
