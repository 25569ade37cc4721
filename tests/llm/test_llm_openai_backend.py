"""The OpenAI-compatible backend against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from coevolve.shared.llm import LLMUnavailable, OpenAIBackend, OpenAISettings, TokenBucket
from coevolve.shared.llm.openai_backend import retry_after_s
from coevolve.shared.runtime.nats_server import free_port
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured
from tests.support.fake_llm import FakeOpenAI, Reply, completion


class Capital(msgspec.Struct, forbid_unknown_fields=True):
    city: str
    population: int


CAPITAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Capital of France, as JSON."}]


def settings(base_url: str, **overrides: Any) -> OpenAISettings:
    fast = {
        "model": "fake-model",
        "api_key": "sk-test",
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.2,
        "max_retries": 5,
        "give_up_after_s": 10.0,
        "requests_per_s": 1000.0,
        "burst": 100,
        "connect_timeout_s": 1.0,
        "timeout_s": 5.0,
    }
    return OpenAISettings(base_url=base_url, **{**fast, **overrides})


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI().start()
    yield fake
    fake.stop()


def ask(backend: OpenAIBackend, counter: RejectionCounter | None = None) -> Capital | Rejection:
    async def go() -> Capital | Rejection:
        try:
            return await ask_structured(
                backend,
                QUESTION,
                Capital,
                schema=CAPITAL_SCHEMA,
                max_tokens=64,
                temperature=0.0,
                counter=counter,
            )
        finally:
            await backend.aclose()

    return asyncio.run(go())


def test_structured_output_parses_and_request_carries_the_schema(server: FakeOpenAI) -> None:
    server.reply(completion('{"city":"Paris","population":2102650}'))
    backend = OpenAIBackend(settings(server.base_url))
    counter = RejectionCounter()
    assert ask(backend, counter) == Capital(city="Paris", population=2102650)
    assert counter.accepted == 1 and counter.total_rejected == 0

    sent = server.requests[0]
    assert sent["model"] == "fake-model"
    assert sent["messages"] == QUESTION
    assert sent["max_tokens"] == 64 and sent["temperature"] == 0.0
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"] == CAPITAL_SCHEMA
    assert server.headers[0]["authorization"] == "Bearer sk-test"


def test_chat_response_fields(server: FakeOpenAI) -> None:
    server.reply(completion('{"a": 1}', model="served-name"))
    backend = OpenAIBackend(settings(server.base_url))

    async def go() -> None:
        response = await backend.chat(
            QUESTION, schema={"type": "object"}, max_tokens=8, temperature=1.0
        )
        plain = await backend.chat(QUESTION, max_tokens=8, temperature=1.0)
        await backend.aclose()
        assert response.parsed == {"a": 1} and response.model == "served-name"
        assert response.prompt_tokens == 11 and response.completion_tokens == 7
        assert plain.parsed is None and "response_format" not in server.requests[1]

    asyncio.run(go())


HUGE = '{"city":"' + "A" * 200_000 + '","population":1}'


@pytest.mark.parametrize(
    ("reply", "kind", "reason_part"),
    [
        (completion('{"city":"Par', finish_reason="length"), "truncated", "finish_reason=length"),
        (completion('{"city":"Paris","population":'), "truncated", "truncated"),
        (completion('{"town":"Paris"}'), "wrong_schema", "Capital"),
        (completion('{"city":"Paris","population":"many"}'), "wrong_schema", "population"),
        (completion(""), "empty", "no text"),
        (completion(None), "empty", "no text"),
        (completion("   \n"), "empty", "no text"),
        (completion(HUGE), "too_large", "exceeds"),
        (completion("Paris, about two million people."), "invalid_json", "not JSON"),
        (Reply(200, b"<html>gateway</html>"), "bad_response", "not a chat completion"),
        (Reply(200, b'{"choices": []}'), "bad_response", "not a chat completion"),
        (Reply(400, b'{"error":"bad schema"}'), "http_error", "HTTP 400"),
    ],
    ids=[
        "truncated-length",
        "truncated-stop",
        "wrong-fields",
        "wrong-type",
        "empty",
        "null",
        "blank",
        "huge",
        "prose",
        "not-json-body",
        "no-choices",
        "http-400",
    ],
)
def test_malformed_output_is_a_counted_rejection(
    server: FakeOpenAI, reply: Reply, kind: str, reason_part: str
) -> None:
    server.reply(reply)
    counter = RejectionCounter()
    # the dialect is fixed: a 400 is not taken as a refusal of json_schema here
    outcome = ask(
        OpenAIBackend(settings(server.base_url, structured_output="json_schema")), counter
    )
    assert isinstance(outcome, Rejection)
    assert outcome.kind == kind
    assert reason_part in outcome.reason
    assert counter.rejected == {kind: 1} and counter.accepted == 0
    assert len(server.requests) == 1  # bad output is not retried


def test_response_over_the_byte_limit_is_refused_while_reading(server: FakeOpenAI) -> None:
    server.reply(completion(HUGE))
    counter = RejectionCounter()
    outcome = ask(OpenAIBackend(settings(server.base_url, max_response_bytes=50_000)), counter)
    assert isinstance(outcome, Rejection) and outcome.kind == "too_large"
    assert "50000 bytes" in outcome.reason


def test_many_malformed_outputs_are_all_counted(server: FakeOpenAI) -> None:
    server.reply(
        completion(""),
        completion('{"city":'),
        completion("[]"),
        completion('{"city":"Paris","population":3}'),
    )
    counter = RejectionCounter()
    backend = OpenAIBackend(settings(server.base_url))

    async def go() -> list[Capital | Rejection]:
        outcomes = [
            await ask_structured(
                backend,
                QUESTION,
                Capital,
                schema=CAPITAL_SCHEMA,
                max_tokens=8,
                temperature=0.0,
                counter=counter,
            )
            for _ in range(4)
        ]
        await backend.aclose()
        return outcomes

    outcomes = asyncio.run(go())
    assert outcomes[-1] == Capital(city="Paris", population=3)
    assert counter.snapshot() == {
        "accepted": 1,
        "rejected.empty": 1,
        "rejected.truncated": 1,
        "rejected.wrong_schema": 1,
    }


def test_server_errors_are_retried_with_back_off(server: FakeOpenAI) -> None:
    server.reply(
        Reply(503, b"busy"), Reply(500, b"oops"), completion('{"city":"Rome","population":1}')
    )
    backend = OpenAIBackend(settings(server.base_url))
    assert ask(backend) == Capital(city="Rome", population=1)
    assert len(server.requests) == 3
    assert backend.stats.retries == 2


def test_429_retry_after_is_honoured(server: FakeOpenAI) -> None:
    server.reply(
        Reply(429, b'{"error":"slow down"}', {"retry-after": "1"}),
        completion('{"city":"Oslo","population":2}'),
    )
    backend = OpenAIBackend(settings(server.base_url, backoff_max_s=5.0))
    started = time.monotonic()
    assert ask(backend) == Capital(city="Oslo", population=2)
    assert time.monotonic() - started >= 1.0
    assert backend.stats.retries == 1


def test_unreachable_endpoint_backs_off_and_recovers() -> None:
    """Nothing listens at first; the server comes up 1.5 s later; the call succeeds."""
    late = FakeOpenAI(default=completion('{"city":"Lima","population":9}'))
    backend = OpenAIBackend(
        settings(late.base_url, backoff_base_s=0.05, backoff_max_s=0.5, max_retries=100)
    )
    started = time.monotonic()
    timer = late.start_after(1.5)
    try:
        assert ask(backend) == Capital(city="Lima", population=9)
    finally:
        timer.join()
        late.stop()
    elapsed = time.monotonic() - started
    assert elapsed >= 1.5
    assert backend.stats.retries >= 2  # it did fail, back off, and try again
    assert len(late.requests) == 1  # and the first request that reached the server worked


def test_endpoint_that_never_returns_raises_unavailable_after_the_budget() -> None:
    backend = OpenAIBackend(
        settings(f"http://127.0.0.1:{free_port()}/v1", max_retries=3, backoff_max_s=0.05)
    )
    counter = RejectionCounter()
    with pytest.raises(LLMUnavailable, match="after 4 attempts"):
        ask(backend, counter)
    assert counter.total_rejected == 0  # unavailable is "retry later", not a bad output
    assert backend.stats.unavailable == 1


@pytest.mark.parametrize("status", [401, 403, 404])
def test_endpoint_misconfiguration_is_unavailable_not_a_rejection(
    server: FakeOpenAI, status: int
) -> None:
    server.reply(Reply(status, b'{"error":"no such model"}'))
    counter = RejectionCounter()
    with pytest.raises(LLMUnavailable, match=f"HTTP {status}"):
        ask(OpenAIBackend(settings(server.base_url)), counter)
    assert len(server.requests) == 1 and counter.total_rejected == 0


def test_give_up_after_wall_clock_budget() -> None:
    """The time budget ends the retries, long before the retry count would."""
    backend = OpenAIBackend(
        settings(
            f"http://127.0.0.1:{free_port()}/v1",
            max_retries=1000,
            backoff_base_s=0.2,
            backoff_max_s=0.2,
            give_up_after_s=1.0,
        )
    )
    with pytest.raises(LLMUnavailable) as raised:
        ask(backend)
    found = re.search(r"unavailable after (\d+) attempts in ([\d.]+)s", str(raised.value))
    assert found is not None, raised.value
    attempts, spent_s = int(found.group(1)), float(found.group(2))
    assert attempts < 1000 and backend.stats.retries == attempts - 1
    assert spent_s >= 0.8  # no retry fits once the next wait would pass the 1 s budget


def test_rate_limit_paces_requests(server: FakeOpenAI) -> None:
    server.default = completion('{"city":"Bern","population":1}')
    backend = OpenAIBackend(settings(server.base_url, requests_per_s=20.0, burst=1))

    async def go() -> float:
        started = time.monotonic()
        await asyncio.gather(
            *(backend.chat(QUESTION, max_tokens=4, temperature=0.0) for _ in range(6))
        )
        await backend.aclose()
        return time.monotonic() - started

    elapsed = asyncio.run(go())
    assert len(server.requests) == 6
    assert elapsed >= 5 / 20.0 * 0.95  # five waits of 1/20 s after the first token
    assert backend.stats.rate_limited_s > 0.2


def test_token_bucket_burst_then_rate() -> None:
    async def go() -> list[float]:
        bucket = TokenBucket(rate=50.0, capacity=3)
        return [await bucket.acquire() for _ in range(5)]

    waits = asyncio.run(go())
    assert all(w < 0.01 for w in waits[:3])
    assert all(w >= 0.015 for w in waits[3:])  # one token per 1/50 s


def test_retry_after_parsing() -> None:
    assert retry_after_s(httpx.Headers({"retry-after": "2.5"})) == 2.5
    assert retry_after_s(httpx.Headers({})) is None
    assert retry_after_s(httpx.Headers({"retry-after": "soon"})) is None
    date = "Wed, 21 Oct 2015 07:28:10 GMT"
    assert retry_after_s(httpx.Headers({"retry-after": date}), now=1445412480.0) == 10.0


def test_request_body_is_valid_json_with_extra_body(server: FakeOpenAI) -> None:
    backend = OpenAIBackend(settings(server.base_url, extra_body={"top_p": 0.9}))

    async def go() -> None:
        await backend.chat(QUESTION, max_tokens=4, temperature=0.5)
        await backend.aclose()

    asyncio.run(go())
    assert server.requests[0]["top_p"] == 0.9
    assert json.loads(json.dumps(server.requests[0])) == server.requests[0]


def test_auto_dialect_falls_back_to_json_object_once(server: FakeOpenAI) -> None:
    # llama-cpp-python's server refuses the json_schema form with a validation error (422)
    server.reply(
        Reply(422, b'{"detail":[{"loc":["body","response_format","type"]}]}'),
        completion('{"city":"Paris","population":1}'),
        completion('{"city":"Lyon","population":2}'),
    )
    backend = OpenAIBackend(settings(server.base_url))

    async def go() -> list[Capital | Rejection]:
        try:
            return [
                await ask_structured(
                    backend, QUESTION, Capital, schema=CAPITAL_SCHEMA, max_tokens=9, temperature=0
                )
                for _ in range(2)
            ]
        finally:
            await backend.aclose()

    assert asyncio.run(go()) == [Capital("Paris", 1), Capital("Lyon", 2)]
    formats = [request["response_format"] for request in server.requests]
    assert [f["type"] for f in formats] == ["json_schema", "json_object", "json_object"]
    assert formats[1]["schema"] == CAPITAL_SCHEMA and backend.dialect == "json_object"


def test_configured_dialect_is_sent_from_the_first_call(server: FakeOpenAI) -> None:
    server.reply(completion('{"city":"Paris","population":1}'))
    backend = OpenAIBackend(settings(server.base_url, structured_output="json_object"))
    assert ask(backend) == Capital("Paris", 1)
    assert server.requests[0]["response_format"] == {
        "type": "json_object",
        "schema": CAPITAL_SCHEMA,
    }


def test_a_refusal_in_both_dialects_is_a_counted_rejection(server: FakeOpenAI) -> None:
    server.reply(Reply(400, b'{"error":"no"}'), Reply(400, b'{"error":"still no"}'))
    counter = RejectionCounter()
    outcome = ask(OpenAIBackend(settings(server.base_url)), counter)
    assert isinstance(outcome, Rejection) and outcome.kind == "http_error"
    assert counter.rejected["http_error"] == 1 and len(server.requests) == 2
