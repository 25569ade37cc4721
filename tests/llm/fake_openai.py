"""A tiny OpenAI-compatible HTTP server on 127.0.0.1 for the backend tests.

It speaks real HTTP (stdlib ``ThreadingHTTPServer``) and answers ``POST
/v1/chat/completions`` with scripted replies, recording every request body; the remote
LLM is the only thing the tests stand in for.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def completion(content: str | None, finish_reason: str = "stop", model: str = "fake") -> Reply:
    payload = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }
    return Reply(200, json.dumps(payload).encode())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class FakeOpenAI:
    """Replies from ``script`` in order, then ``default`` forever."""

    def __init__(self, port: int | None = None, default: Reply | None = None) -> None:
        self.port = port or free_port()
        self.default = default or completion('{"ok":true}')
        self.script: deque[Reply] = deque()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def reply(self, *replies: Reply) -> FakeOpenAI:
        self.script.extend(replies)
        return self

    def start(self) -> FakeOpenAI:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                raw = self.rfile.read(length)
                fake.requests.append(json.loads(raw) if raw else {})
                fake.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.path != "/v1/chat/completions":
                    answer = Reply(404, b'{"error":"not found"}')
                else:
                    answer = fake.script.popleft() if fake.script else fake.default
                self.send_response(answer.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer.body)))
                for key, value in answer.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(answer.body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def start_after(self, delay_s: float) -> threading.Timer:
        timer = threading.Timer(delay_s, self.start)
        timer.start()
        return timer

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
