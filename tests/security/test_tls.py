"""TLS for a bus across hosts: a real nats-server with a certificate this test issues."""

from __future__ import annotations

import contextlib
from pathlib import Path

import nats.errors
import pytest

from coevolve.shared.config import BusSettings, BusTls, load_settings
from coevolve.shared.messages import TaskAdded, decode
from coevolve.shared.runtime.bus import Bus, BusError
from coevolve.shared.runtime.credentials import generate_credentials
from coevolve.shared.runtime.nats_server import NatsServer, ServerTls
from tests.security.certs import CertificateAuthority

pytestmark = pytest.mark.anyio


@pytest.fixture
def tls_server(tmp_path: Path) -> tuple[NatsServer, CertificateAuthority, Path]:
    ca = CertificateAuthority(tmp_path / "pki")
    server_cert = ca.issue("server", server=True)
    secrets = tmp_path / "secrets"
    server = NatsServer(
        tmp_path / "nats",
        log_file=tmp_path / "nats.log",
        credentials=generate_credentials(secrets),
        tls=ServerTls(server_cert.cert, server_cert.key, ca.ca),
    ).start()
    yield server, ca, secrets
    server.stop()


async def test_mutual_tls_with_credentials_carries_messages(
    tls_server: tuple[NatsServer, CertificateAuthority, Path],
) -> None:
    server, ca, secrets = tls_server
    client = ca.issue("rollout-client", server=False)
    settings = BusSettings(
        url=server.url,
        credentials_dir=str(secrets),
        tls=BusTls(ca=str(ca.ca), cert=str(client.cert), key=str(client.key)),
    )
    reader = await Bus.connect(settings, "reader", user="reader")
    pool = await Bus.connect(settings, "pool_store", user="pool_store")
    try:
        assert reader.nc.connected_url is not None
        subscription = await reader.nc.subscribe("coevolve.pool.task_added")
        await reader.nc.flush()
        # core NATS drops what is published while a connection is being re-made (a loaded
        # machine can make it), so publish until one arrives
        added = TaskAdded(task_id="t1", origin="seed")
        for _ in range(30):
            await pool.publish_core("coevolve.pool.task_added", added)
            await pool.nc.flush()
            with contextlib.suppress(nats.errors.TimeoutError):
                message = await subscription.next_msg(timeout=2)
                break
        else:
            raise AssertionError("no message arrived over mutual TLS")
        assert decode(message.data, TaskAdded).task_id == "t1"
    finally:
        await pool.close()
        await reader.close()


async def test_a_client_without_tls_or_without_a_certificate_is_refused(
    tls_server: tuple[NatsServer, CertificateAuthority, Path],
) -> None:
    server, ca, secrets = tls_server
    plain = BusSettings(url=server.url, credentials_dir=str(secrets), connect_timeout_s=0.5)
    with pytest.raises(BusError):
        await Bus.connect(plain, "plain", user="reader")
    no_cert = BusSettings(
        url=server.url,
        credentials_dir=str(secrets),
        connect_timeout_s=0.5,
        tls=BusTls(ca=str(ca.ca)),
    )
    with pytest.raises(BusError):
        await Bus.connect(no_cert, "no-cert", user="reader")
    # a certificate from another authority is not trusted either way
    stranger = CertificateAuthority(server.store_dir.parent / "other-pki", name="someone else")
    foreign = stranger.issue("client", server=False)
    untrusted = BusSettings(
        url=server.url,
        credentials_dir=str(secrets),
        connect_timeout_s=0.5,
        tls=BusTls(ca=str(stranger.ca), cert=str(foreign.cert), key=str(foreign.key)),
    )
    with pytest.raises(BusError):
        await Bus.connect(untrusted, "untrusted", user="reader")


def test_the_tls_option_reads_from_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    config.write_text(
        "bus:\n  url: tls://nats.internal:4222\n"
        "  tls: {ca: /etc/coevolve/ca.pem, cert: /etc/coevolve/c.pem, key: /etc/coevolve/k.pem}\n"
    )
    settings = load_settings(config, run_dir=str(tmp_path / "run"))
    assert settings.bus.tls == BusTls(
        ca="/etc/coevolve/ca.pem", cert="/etc/coevolve/c.pem", key="/etc/coevolve/k.pem"
    )
