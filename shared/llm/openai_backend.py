"""Any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, SGLang, llama.cpp, ...).

Structured output goes through ``response_format`` in one of two dialects: ``json_schema``
(OpenAI, vLLM, SGLang) or ``json_object`` with a ``schema`` (llama-cpp-python's server,
which enforces it with a grammar and refuses the other form). ``structured_output: auto``
sends ``json_schema`` first and, if the endpoint refuses it (HTTP 400/422), the same
request as ``json_object``; the dialect that worked is kept for every later call.

Transport problems (refused connections, timeouts, 5xx, 429) are retried with exponential
back-off and full jitter, honouring ``Retry-After``; each retry waits at most
``backoff_max_s`` and the whole call gives up after ``max_retries`` retries or
``give_up_after_s`` seconds with :class:`LLMUnavailable`. A token bucket paces requests
so a fleet of explorers does not trip the provider's rate limit in the first place.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import msgspec

from coevolve.shared.llm.client import (
    ChatMessages,
    LLMOutputError,
    LLMResponse,
    LLMUnavailable,
    parse_json_or_none,
)
from coevolve.shared.runtime.backoff import Backoff

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
ENDPOINT_STATUS = frozenset({401, 403, 404})
REFUSED_FORMAT_STATUS = frozenset({400, 422})

Dialect = Literal["json_schema", "json_object"]


class Transport(msgspec.Struct, kw_only=True, frozen=True):
    """How a client talks to an endpoint: its key, output format, timeouts, retries and
    limits (a role's settings hold these too: ``roles.RoleSettings``)."""

    api_key_env: str | None = "OPENAI_API_KEY"
    structured_output: Literal["auto", "json_schema", "json_object"] = "auto"
    connect_timeout_s: float = 5.0
    max_retries: int = 8
    give_up_after_s: float = 300.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    requests_per_s: float = 5.0
    burst: int = 5
    max_response_bytes: int = 4_000_000


class OpenAISettings(Transport, kw_only=True, frozen=True):
    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0
    # requests in flight at once from this client (a llama.cpp server runs one at a time;
    # more only queue there, and their timeouts run out while they wait)
    max_concurrency: int = 8
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None


class TokenBucket:
    """At most ``rate`` acquisitions per second on average, ``capacity`` at once."""

    def __init__(self, rate: float, capacity: int) -> None:
        if rate <= 0 or capacity < 1:
            raise ValueError("rate must be > 0 and capacity >= 1")
        self.rate = rate
        self.capacity = float(capacity)
        self._tokens = float(capacity)
        self._updated = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> float:
        """Take one token, waiting (first come, first served) until one is available;
        returns the seconds this call waited."""
        started = time.monotonic()
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
                self._updated = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return now - started
                await asyncio.sleep((1.0 - self._tokens) / self.rate)


def retry_after_s(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds the server asked us to wait (``Retry-After`` as seconds or an HTTP date)."""
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def response_format(
    schema: dict[str, Any], dialect: Dialect = "json_schema", name: str = "output"
) -> dict[str, Any]:
    """The ``response_format`` asking for JSON that follows ``schema``, in ``dialect``."""
    if dialect == "json_object":
        return {"type": "json_object", "schema": schema}
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": True},
    }


@dataclass
class BackendStats:
    requests: int = 0
    retries: int = 0
    unavailable: int = 0
    rate_limited_s: float = 0.0


class OpenAIBackend:
    """An :class:`~coevolve.shared.llm.client.LLMClient` over HTTP."""

    def __init__(
        self,
        settings: OpenAISettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        seed: int | None = None,
    ) -> None:
        self.settings = settings
        self.name = f"openai:{settings.model}"
        headers = {"content-type": "application/json"}
        if key := settings.resolved_api_key():
            headers["authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
        self._http = httpx.AsyncClient(
            base_url=settings.base_url.rstrip("/"),
            headers=headers,
            timeout=timeout,
            transport=transport,
        )
        self._bucket = TokenBucket(settings.requests_per_s, settings.burst)
        self._slots = asyncio.Semaphore(max(1, settings.max_concurrency))
        self._rng = random.Random(seed)
        self.dialect: Dialect | None = (
            None if settings.structured_output == "auto" else settings.structured_output
        )
        self.stats = BackendStats()

    async def chat(
        self,
        messages: ChatMessages,
        *,
        schema: dict[str, Any] | None = None,
        max_tokens: int,
        temperature: float,
    ) -> LLMResponse:
        body: dict[str, Any] = {
            "model": self.settings.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **self.settings.extra_body,
        }
        if schema is None:
            payload, attempts = await self._post_with_retries(body)
            return self._to_response(payload, False, attempts)
        if self.dialect is not None:
            body["response_format"] = response_format(schema, self.dialect)
            payload, attempts = await self._post_with_retries(body)
            return self._to_response(payload, True, attempts)
        payload, attempts = await self._detect_dialect(body, schema)
        return self._to_response(payload, True, attempts)

    async def _detect_dialect(
        self, body: dict[str, Any], schema: dict[str, Any]
    ) -> tuple[bytes, int]:
        """Try ``json_schema``, then ``json_object``; remember the one the endpoint took."""
        try:
            payload, attempts = await self._post_with_retries(
                {**body, "response_format": response_format(schema, "json_schema")}
            )
        except LLMOutputError as exc:
            if exc.status not in REFUSED_FORMAT_STATUS and exc.kind != "format_refused":
                raise
            log.info("endpoint refused json_schema (%s); trying json_object", exc)
            payload, attempts = await self._post_with_retries(
                {**body, "response_format": response_format(schema, "json_object")}
            )
            self.dialect = "json_object"
        else:
            self.dialect = "json_schema"
        log.info("%s: structured output through response_format %s", self.name, self.dialect)
        return payload, attempts

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post_with_retries(self, body: dict[str, Any]) -> tuple[bytes, int]:
        settings = self.settings
        started = time.monotonic()
        attempt = 0
        backoff = Backoff(
            settings.backoff_base_s, settings.backoff_max_s, jitter=True, rng=self._rng
        )
        while True:
            self.stats.rate_limited_s += await self._bucket.acquire()
            self.stats.requests += 1
            failure, wait_hint = "", None
            try:
                async with self._slots:
                    status, headers, content = await self._post_once(body)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if status < 300:
                    return content, attempt + 1
                snippet = content[:300].decode("utf-8", "replace")
                if status in ENDPOINT_STATUS:
                    # Wrong URL, model or key: every request would fail the same way, so
                    # this is no verdict on the work item; the caller retries it later.
                    self.stats.unavailable += 1
                    raise LLMUnavailable(f"HTTP {status} from {settings.base_url}: {snippet}")
                if status in RETRY_STATUS and "response_format" in snippet:
                    # llama-cpp-python answers an unknown response_format type with a 500
                    # naming the field: a refusal of the dialect, not a server fault
                    raise LLMOutputError(
                        f"HTTP {status}: endpoint refused the response_format: {snippet}",
                        "format_refused",
                        status,
                    )
                if status not in RETRY_STATUS:
                    kind = (
                        "prompt_too_long" if "maximum context length" in snippet else "http_error"
                    )
                    raise LLMOutputError(f"HTTP {status} from endpoint: {snippet}", kind, status)
                failure, wait_hint = f"HTTP {status}: {snippet}", retry_after_s(headers)
            delay = backoff.next_delay()
            if wait_hint is not None:
                delay = max(delay, min(wait_hint, settings.backoff_max_s))
            elapsed = time.monotonic() - started
            if attempt >= settings.max_retries or elapsed + delay > settings.give_up_after_s:
                self.stats.unavailable += 1
                raise LLMUnavailable(
                    f"{settings.base_url} unavailable after {attempt + 1} attempts "
                    f"in {elapsed:.1f}s: {failure}"
                )
            log.warning("LLM request failed (%s); retry %d in %.2fs", failure, attempt + 1, delay)
            self.stats.retries += 1
            attempt += 1
            await asyncio.sleep(delay)

    async def _post_once(self, body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        limit = self.settings.max_response_bytes
        async with self._http.stream("POST", "/chat/completions", json=body) as response:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise LLMOutputError(
                        f"response larger than {limit} bytes; refused", "too_large"
                    )
                chunks.append(chunk)
            return response.status_code, response.headers, b"".join(chunks)

    def _to_response(self, content: bytes, structured: bool, attempts: int) -> LLMResponse:
        try:
            payload = json.loads(content)
            choice = payload["choices"][0]
            message = choice["message"]
            text = message.get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            preview = content[:200].decode("utf-8", "replace")
            raise LLMOutputError(f"not a chat completion ({exc!r}): {preview}") from exc
        if not isinstance(text, str):
            raise LLMOutputError(f"message content is {type(text).__name__}, not text")
        usage = payload.get("usage") or {}
        return LLMResponse(
            text=text,
            parsed=parse_json_or_none(text) if structured else None,
            finish_reason=str(choice.get("finish_reason") or "stop"),
            model=str(payload.get("model") or self.settings.model),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            attempts=attempts,
        )
