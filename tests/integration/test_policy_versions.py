"""Policy versions are unique and verified: real NATS, the real learner and rollout code."""

from __future__ import annotations

import logging

import anyio
import msgspec
import pytest

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.config import Settings
from coevolve.shared.policy import export_weights, load_policy, weights_digest
from coevolve.shared.policy_sync import latest_policy, publish_policy
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import POLICY_BUCKET, POLICY_UPDATES, stream_for

pytestmark = pytest.mark.anyio


async def connected(settings: Settings) -> Bus:
    bus = await Bus.connect(settings.bus, "test")
    await bus.ensure_streams()
    return bus


async def announcements(bus: Bus) -> int:
    info = await bus.js.stream_info(stream_for(POLICY_UPDATES).name)
    return int(info.state.messages)


async def test_one_version_number_with_other_weights_is_a_new_announcement(
    loop_settings: Settings,
) -> None:
    bus = await connected(loop_settings)
    first = await publish_policy(bus, b"weights-a", version=3, step=3, base_model="m", kind="lora")
    again = await publish_policy(bus, b"weights-a", version=3, step=3, base_model="m", kind="lora")
    other = await publish_policy(bus, b"weights-b", version=3, step=3, base_model="m", kind="lora")
    assert first.id == again.id  # a retried publish is de-duplicated ...
    assert other.id != first.id  # ... other weights under the same number are not hidden
    assert await announcements(bus) == 2
    await bus.close()


async def test_restarted_learner_never_reannounces_a_version_with_other_weights(
    loop_settings: Settings,
) -> None:
    bus = await connected(loop_settings)
    learner = LearnerActor(loop_settings)
    learner._bus = bus
    await learner.setup()  # no warm start: v0 is announced for rollout to start from
    assert learner.learner is not None and learner.learner.version == 0
    assert (await latest_policy(bus)).version == 0  # type: ignore[union-attr]
    learner.learner.version = 2  # an older checkpoint, restored after v2 and v3 went out
    await publish_policy(bus, b"other-v2", version=2, step=2, base_model="m", kind="lora")
    await publish_policy(bus, b"other-v3", version=3, step=3, base_model="m", kind="lora")

    await learner._announce_if_newer()

    latest = await latest_policy(bus)
    assert latest is not None and latest.version == 4
    assert latest.sha256 == weights_digest(learner.learner.export_weights())
    assert learner.learner.version == 4
    assert learner.checkpoint.exists()  # written before the announcement
    await learner._announce_if_newer()  # the same checkpoint again: nothing new
    assert await announcements(bus) == 4  # v0, the other v2 and v3, and v4
    await bus.close()


async def test_rollout_refuses_weights_whose_digest_differs(
    loop_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    bus = await connected(loop_settings)
    rollout = RolloutActor(loop_settings)
    rollout._bus = bus
    rollout.engine = await anyio.to_thread.run_sync(rollout._load_engine)
    # a fresh LoRA of the rollout's model, as the learner would publish it
    blob = export_weights(load_policy(run_dir=loop_settings.run_dir, device="cpu"))
    update = await publish_policy(bus, blob, version=1, step=1, base_model="m", kind="lora")
    rollout.policies.hear("target", msgspec.structs.replace(update, sha256="0" * 64))

    with caplog.at_level(logging.ERROR):
        await rollout._use("target")

    assert rollout.engine.policy_version == 0
    assert "refused target policy v1" in caplog.text and "sha256" in caplog.text
    rollout.policies.announced["target"] = update  # the true announcement still loads
    await rollout._use("target")
    assert rollout.engine.policy_version == 1
    await bus.close()


async def test_the_bus_keeps_only_each_agents_newest_versions(loop_settings: Settings) -> None:
    from coevolve.shared.policy_sync import PolicySyncError, fetch_policy, policy_bucket

    bus = await connected(loop_settings)
    blobs = {v: bytes([v]) * 200_000 for v in range(1, 6)}
    for version, blob in blobs.items():
        await publish_policy(
            bus, blob, version=version, step=version, base_model="m", kind="lora", keep=2
        )
    failure = await publish_policy(
        bus, b"f" * 1000, version=1, step=1, base_model="m", kind="lora", agent="failure", keep=2
    )
    bucket = await policy_bucket(bus)
    names = sorted(info.name for info in await bucket.list(ignore_deletes=True))
    assert names == ["failure-v00000001", "policy-v00000004", "policy-v00000005"]
    # the deleted versions' chunks are purged: the stream holds about two copies, not five
    stored = (await bus.js.stream_info(f"OBJ_{POLICY_BUCKET}")).state.bytes
    assert 2 * 200_000 <= stored < 3 * 200_000

    newest = await latest_policy(bus)
    assert newest is not None and await fetch_policy(bus, newest) == blobs[5]
    assert await fetch_policy(bus, failure) == b"f" * 1000
    gone = msgspec.structs.replace(newest, version=1, object_name="policy-v00000001")
    with pytest.raises(PolicySyncError, match="no longer in the bus"):
        await fetch_policy(bus, gone)
    await bus.close()


async def test_keep_zero_keeps_every_version(loop_settings: Settings) -> None:
    from coevolve.shared.policy_sync import policy_bucket

    bus = await connected(loop_settings)
    for version in range(1, 4):
        await publish_policy(bus, b"w", version=version, step=version, base_model="m", kind="lora")
    bucket = await policy_bucket(bus)
    assert len(await bucket.list(ignore_deletes=True)) == 3
    await bus.close()
