"""Fake OpenAI-compatible endpoints on 127.0.0.1: the remote LLM is the only thing the tests
stand in for; the services, the bus, the environments and the database are real.

Both speak real HTTP (stdlib ``ThreadingHTTPServer``) and answer ``POST
/v1/chat/completions``, recording every request body:

- ``FakeOpenAI`` answers with scripted replies in order (the backend tests);
- ``RoleFakeLLM`` tells the roles apart by the JSON schema of the request's
  ``response_format`` (summary -> summarizer, request -> abstractor, criteria -> judge,
  labels -> attributor, a function call -> explorer) and answers each with
  ``brain(role, request)``, so a test decides what the "remote LLM" says, including
  malformed answers (the data-loop tests).
"""

from __future__ import annotations

import json
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from coevolve.shared.runtime.nats_server import free_port

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def completion(
    content: str | None, finish_reason: str = "stop", model: str = "fake", status: int = 200
) -> Reply:
    """A chat completion whose one choice says ``content``."""
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
    return Reply(status, json.dumps(payload).encode())


class FakeEndpoint:
    """A threaded HTTP server on 127.0.0.1 that answers every POST with ``respond``."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def respond(self, path: str, headers: dict[str, str], request: dict[str, Any]) -> Reply:
        raise NotImplementedError

    def start(self) -> Self:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                raw = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                answer = endpoint.respond(self.path, headers, json.loads(raw) if raw else {})
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

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeOpenAI(FakeEndpoint):
    """Replies from ``script`` in order, then ``default`` forever."""

    def __init__(self, port: int | None = None, default: Reply | None = None) -> None:
        super().__init__(port)
        self.default = default or completion('{"ok":true}')
        self.script: deque[Reply] = deque()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    def reply(self, *replies: Reply) -> Self:
        self.script.extend(replies)
        return self

    def start_after(self, delay_s: float) -> threading.Timer:
        timer = threading.Timer(delay_s, self.start)
        timer.start()
        return timer

    def respond(self, path: str, headers: dict[str, str], request: dict[str, Any]) -> Reply:
        self.requests.append(request)
        self.headers.append(headers)
        if path != CHAT_PATH:
            return Reply(404, b'{"error":"not found"}')
        return self.script.popleft() if self.script else self.default


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
    if "labels" in properties:
        return "attributor"
    return "explorer"


def offered_functions(request: dict[str, Any]) -> list[str]:
    """The function names an explorer request's schema allows."""
    schema = request["response_format"]["json_schema"]["schema"]
    options = schema.get("anyOf", [schema])
    return [option["properties"]["name"]["const"] for option in options]


def prompt_text(request: dict[str, Any]) -> str:
    return "\n".join(str(m.get("content", "")) for m in request.get("messages", []))


class RoleFakeLLM(FakeEndpoint):
    """Answers each request with ``brain(role, request)``, counting calls per role."""

    def __init__(self, brain: Brain, port: int | None = None) -> None:
        super().__init__(port)
        self.brain = brain
        self.calls: Counter[str] = Counter()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

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

    def respond(self, path: str, headers: dict[str, str], request: dict[str, Any]) -> Reply:
        role = role_of(request)
        with self._lock:
            self.calls[role] += 1
            self.requests.append((role, request))
        answer = self.brain(role, request)
        return completion(answer.content, answer.finish_reason, "fake-remote", answer.status)
