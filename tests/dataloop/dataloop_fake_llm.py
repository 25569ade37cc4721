"""A role-aware OpenAI-compatible endpoint on 127.0.0.1 for the data-loop service tests.

Real HTTP (stdlib ``ThreadingHTTPServer``) answering ``POST /v1/chat/completions``. It
tells the four roles apart by the JSON schema of the request's ``response_format``
(summary -> summarizer, request -> abstractor, criteria -> judge, a function call ->
explorer) and answers each with ``brain(role, request)``, so a test decides what the
"remote LLM" says, including malformed answers. Only the remote LLM is stood in for; the
services, the bus, the environments and the database are real.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Answer:
    content: str
    finish_reason: str = "stop"
    status: int = 200


Brain = Callable[[str, dict[str, Any]], Answer]


def role_of(request: dict[str, Any]) -> str:
    schema = (request.get("response_format") or {}).get("json_schema", {}).get("schema", {})
    properties = schema.get("properties", {})
    if "summary" in properties:
        return "summarizer"
    if "request" in properties:
        return "abstractor"
    if "criteria" in properties:
        return "judge"
    return "explorer"


def offered_functions(request: dict[str, Any]) -> list[str]:
    """The function names an explorer request's schema allows."""
    schema = request["response_format"]["json_schema"]["schema"]
    options = schema.get("anyOf", [schema])
    return [option["properties"]["name"]["const"] for option in options]


def prompt_text(request: dict[str, Any]) -> str:
    return "\n".join(str(m.get("content", "")) for m in request.get("messages", []))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class RoleFakeLLM:
    brain: Brain
    port: int = field(default_factory=free_port)
    calls: Counter[str] = field(default_factory=Counter)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def llm_section(self, **overrides: Any) -> dict[str, Any]:
        """The ``services.llm`` settings that point every role here."""
        default = {
            "base_url": self.base_url,
            "model": "fake-remote",
            "api_key_env": None,
            "temperature": 0.0,
            "max_retries": 2,
            "give_up_after_s": 3.0,
            "backoff_base_s": 0.05,
            "backoff_max_s": 0.5,
            "requests_per_s": 1000.0,
            "burst": 100,
            **overrides,
        }
        return {"default": default}

    def _answer(self, request: dict[str, Any]) -> Answer:
        role = role_of(request)
        with self._lock:
            self.calls[role] += 1
            self.requests.append((role, request))
        return self.brain(role, request)

    def start(self) -> RoleFakeLLM:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                request = json.loads(self.rfile.read(length) or b"{}")
                answer = fake._answer(request)
                payload = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "model": "fake-remote",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": answer.content},
                            "finish_reason": answer.finish_reason,
                        }
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 10},
                }
                body = json.dumps(payload).encode()
                self.send_response(answer.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
