"""A 3-node JetStream cluster on loopback: streams with 3 replicas survive losing the node
that leads them, refuse writes without quorum, and lose nothing once a node returns."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from coevolve.shared.config import load_settings
from coevolve.shared.messages import Metric
from coevolve.shared.runtime.bus import Bus, StreamUnavailableError, leaderless_hint, server_urls
from coevolve.shared.runtime.credentials import CREDENTIALS_DIR_ENV, USER_ENV, load_credentials
from coevolve.shared.runtime.nats_server import NatsCluster, NatsServer
from coevolve.shared.runtime.permissions import ADMIN, USERS
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS, stream_for

pytestmark = pytest.mark.anyio
STREAM = stream_for(ROLLOUT_GROUPS).name


async def publish_until_accepted(bus: Bus, payload: bytes, timeout_s: float) -> None:
    """Publish ``payload``, retrying while the cluster fails over, until it is accepted."""
    with anyio.fail_after(timeout_s):
        while True:
            try:
                await bus.js.publish(ROLLOUT_GROUPS, payload, timeout=1.0)
                return
            except Exception:  # no leader yet: the client's error is what a service sees
                await anyio.sleep(0.2)


async def stored(bus: Bus) -> int:
    with anyio.fail_after(10):
        while True:
            try:
                info = await bus.js.stream_info(STREAM)
                return int(info.state.messages)
            except Exception:
                await anyio.sleep(0.2)


def kill(node: NatsServer) -> None:
    assert node.process is not None
    os.kill(node.process.pid, signal.SIGKILL)
    node.process.wait(5)


async def test_streams_survive_losing_their_leader_and_wait_out_a_lost_quorum(
    tmp_path: Path, nats_credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = {user: load_credentials(nats_credentials / f"{user}.json") for user in USERS}
    cluster = NatsCluster(tmp_path / "nats", 3, log_dir=tmp_path / "logs", credentials=credentials)
    monkeypatch.setenv(CREDENTIALS_DIR_ENV, str(nats_credentials))
    monkeypatch.setenv(USER_ENV, ADMIN)
    with cluster:
        settings = load_settings(run_dir=str(tmp_path / "run"))
        settings.bus.url = cluster.url
        settings.bus.replicas = 3
        assert len(server_urls(settings.bus.url)) == 3
        bus = await Bus.connect(settings.bus, "test")
        await bus.ensure_streams()
        info = await bus.js.stream_info(STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        for i in range(5):
            await bus.js.publish(ROLLOUT_GROUPS, f"group-{i}".encode())

        leader = cluster.node(str(info.cluster.leader))
        kill(leader)  # the node leading the rollout-groups stream
        await publish_until_accepted(bus, b"after-failover", 90)  # a new leader takes it
        moved = await bus.js.stream_info(STREAM)
        assert moved.cluster is not None and moved.cluster.leader != leader.cluster.node  # type: ignore[union-attr]
        assert await stored(bus) == 6

        second = cluster.node(str(moved.cluster.leader))
        kill(second)  # one node of three left: no quorum, writes are refused
        with pytest.raises(TimeoutError):
            await publish_until_accepted(bus, b"without-quorum", 5)
        bus.settings.publish_timeout_s = 2.0  # what a service sees, and says
        with pytest.raises(StreamUnavailableError, match=r"lost quorum \(fewer than 2 of its 3"):
            await bus.publish(ROLLOUT_GROUPS, Metric(service="test", name="probe", value=1.0))

        leader.start()  # a node returns: quorum again, nothing lost
        await publish_until_accepted(bus, b"quorum-back", 60)
        assert await stored(bus) == 7
        second.start()
        await bus.close()


def test_a_consumer_or_heartbeat_without_a_stream_leader_logs_what_it_means() -> None:
    for error in (ServiceUnavailableError(), NoStreamResponseError()):
        assert "lost quorum" in leaderless_hint(error)
    assert leaderless_hint(ValueError("other")) == ""
