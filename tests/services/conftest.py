"""Tests of one service each: actors run on asyncio (anyio's pytest plugin); services that
ask an LLM role ask the scripted OpenAI endpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fake_llm import FakeOpenAI


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def endpoint() -> Iterator[FakeOpenAI]:
    """The scripted OpenAI endpoint on loopback, stopped after the test."""
    with FakeOpenAI() as server:
        yield server
