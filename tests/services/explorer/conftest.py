"""The explorer tests' scripted OpenAI endpoint on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fake_llm import FakeOpenAI


@pytest.fixture
def endpoint() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server
