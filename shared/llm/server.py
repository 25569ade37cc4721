"""A local llama.cpp server (``llama-cpp-python[server]``) serving the LLM roles.

When the configuration names no endpoint for some role, ``coevolve up`` starts one of
these before the services, the way it starts NATS: a child process in its own process
group, on a free port of 127.0.0.1, with a random API key, its output in
``RUN_DIR/logs/llm.log``, healthy once ``GET /v1/models`` answers. A watchdog thread
restarts it with back-off if it dies; ``stop()`` ends it with everything else. The
services find it through the environment (:meth:`LlamaServer.environment`).

The server runs one request at a time (llama-cpp-python serializes them behind a lock),
keeps the last prompt's KV cache, and with ``cache`` a RAM cache of earlier prompts'
states, so the roles' long fixed prefixes are evaluated once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx
import msgspec

from coevolve.shared.llm.model_file import DEFAULT_MODEL, ROLE_MODELS, ModelFileError, model_path
from coevolve.shared.runtime.backoff import Backoff
from coevolve.shared.runtime.child_process import child_setup
from coevolve.shared.runtime.nats_server import free_port, port_open

log = logging.getLogger(__name__)

BASE_URL_ENV = "COEVOLVE_LLM_BASE_URL"
API_KEY_ENV = "COEVOLVE_LLM_API_KEY"
MODEL_ENV = "COEVOLVE_LLM_MODEL"


class LLMServerError(RuntimeError):
    """The local LLM server cannot be started (not installed, no model, did not come up)."""


class ServerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The ``llm.server`` config section: the local server started when a role has no
    ``base_url``."""

    # one of ROLE_MODELS, assembled from its part packages on first use
    model: str = DEFAULT_MODEL.alias
    model_path: str | None = None  # a GGUF file of your own (overrides model)
    model_alias: str | None = None  # the name it serves under; default: derived from the file
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    n_ctx: int = 8192
    # One thread, like every model process here: on 2 shared cores llama.cpp's threads wait
    # on each other while the policy and learner run (measured: a 30-token JSON reply took
    # 22.5 s with 2 threads, 1.4 s with 1, load average 4). 0: the cores, at most 4 (a GPU
    # box or a machine of its own).
    n_threads: int = 1
    # added to the server's niceness: the roles take what the policy's rollout and the
    # learner leave of the cores (0: equal priority, as before)
    niceness: int = 10
    n_batch: int = 512
    # RAM cache of prompt states (prefix reuse across roles). Off: llama-cpp-python counts
    # only a state's KV against cache_size, but each state also copies the logits buffer
    # (n_batch x 151,936 floats, 311 MB here), so the cache grew past its size; with the
    # server's default logits for every position (n_ctx x vocab, 5 GB a copy) it reached
    # 13.6 GB and was OOM-killed in two 30-minute runs. Without it the server still reuses
    # the previous prompt's prefix.
    cache: bool = False
    cache_size_mb: int = 1024
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if not 0 <= self.niceness <= 19:
            raise ValueError(f"llm.server.niceness must be between 0 and 19, not {self.niceness}")
        if self.model not in ROLE_MODELS:
            raise ValueError(
                f"llm.server.model {self.model!r} is not one of {', '.join(ROLE_MODELS)} "
                "(or set llm.server.model_path to a GGUF file)"
            )


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class LlamaServer:
    """One ``python -m llama_cpp.server`` child process."""

    def __init__(
        self,
        settings: ServerSettings | None = None,
        *,
        log_file: Path | None = None,
        api_key: str | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings or ServerSettings()
        self.log_file = log_file
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.port = self.settings.port
        self.host = self.settings.host
        self.alias = self.settings.model_alias or (
            self.settings.model
            if self.settings.model_path is None
            else Path(self.settings.model_path).stem
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._on_event = on_event or log.info
        self._log_handle: IO[bytes] | None = None
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._argv: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def environment(self) -> dict[str, str]:
        """What a service needs to reach this server (see ``roles.make_backend``)."""
        return {BASE_URL_ENV: self.base_url, API_KEY_ENV: self.api_key, MODEL_ENV: self.alias}

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, watch: bool = True) -> LlamaServer:
        """Start the process and return once it answers; with ``watch``, restart it with
        back-off whenever it exits until :meth:`stop`."""
        if not llama_cpp_installed():
            raise LLMServerError(
                "llama-cpp-python is not installed: run deploy/install.sh, or name an "
                "OpenAI-compatible endpoint (llm.default.base_url and model) in the config"
            )
        try:
            model = (
                Path(self.settings.model_path).expanduser()
                if self.settings.model_path
                else model_path(ROLE_MODELS[self.settings.model])
            )
        except ModelFileError as exc:
            raise LLMServerError(str(exc)) from exc
        if not model.is_file():
            raise LLMServerError(f"model file {model} does not exist")
        if self.port == 0:
            self.port = free_port()
        if port_open(self.host, self.port):
            raise LLMServerError(f"port {self.port} is already in use")
        self._argv = self._command(model)
        self._stopping.clear()
        self._spawn()
        try:
            self.wait_healthy(self.settings.start_timeout_s)
        except LLMServerError:
            self.stop()
            raise
        if watch:
            self._watchdog = threading.Thread(target=self._watch, name="llm-server", daemon=True)
            self._watchdog.start()
        return self

    def _command(self, model: Path) -> list[str]:
        s = self.settings
        threads = s.n_threads or default_threads()
        argv = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--model_alias",
            self.alias,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--n_ctx",
            str(s.n_ctx),
            "--n_batch",
            str(s.n_batch),
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--n_gpu_layers",
            "0",
            # the roles never ask for logprobs: keep logits of the last position only, not a
            # (n_ctx x vocab) float32 buffer (5 GB at 8,192 tokens)
            "--logits_all",
            "false",
            "--verbose",
            "false",
        ]
        if s.cache:
            argv += ["--cache", "true", "--cache_size", str(s.cache_size_mb * 1024 * 1024)]
        return argv

    def _spawn(self) -> None:
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            if self._log_handle is None:
                self._log_handle = self.log_file.open("ab")
        output: IO[bytes] | int = (
            self._log_handle if self._log_handle is not None else subprocess.DEVNULL
        )
        self.process = subprocess.Popen(
            self._argv,
            # the key goes by environment (the server's settings read API_KEY), not argv:
            # argv is readable by every user, and a key that starts with "-" reads as a flag
            env={**os.environ, "API_KEY": self.api_key},
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=child_setup(self.settings.niceness),
        )

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            response = httpx.get(
                f"{self.base_url}/models",
                headers={"authorization": f"Bearer {self.api_key}"},
                timeout=timeout_s,
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            process = self.process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise LLMServerError(
                    f"the LLM server exited with {code} while starting; {self._log_tail()}"
                )
            if port_open(self.host, self.port) and self.healthy():
                return
            time.sleep(0.2)
        raise LLMServerError(
            f"the LLM server did not answer on {self.base_url} within {timeout_s:.0f} s; "
            f"{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 15) -> str:
        if self.log_file is None or not self.log_file.is_file():
            return "no log"
        tail = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        return f"log {self.log_file}:\n" + "\n".join(tail)

    def _watch(self) -> None:
        backoff = Backoff(1.0, 30.0)
        started = time.monotonic()
        while not self._stopping.wait(0.5):
            process = self.process
            if process is None or process.poll() is None:
                if time.monotonic() - started > 60.0:
                    backoff.reset()
                continue
            wait_s = backoff.next_delay()
            self._on_event(
                f"LLM server exited with {process.returncode}; restarting in {wait_s:.0f} s "
                f"(log: {self.log_file})"
            )
            if self._stopping.wait(wait_s):
                return
            self.restarts += 1
            self._spawn()
            started = time.monotonic()

    def kill(self) -> None:
        """SIGKILL the process (as a crash would); the watchdog, if any, restarts it."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``: the server keeps no state worth a
        longer wait, and `coevolve up` must be down within 10 s."""
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout_s)
            self._watchdog = None
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
