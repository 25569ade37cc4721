"""The real llama.cpp server of tests/llm, for the judge's LLM stages (one per session)."""

from tests.llm.conftest import llama_server

__all__ = ["llama_server"]
