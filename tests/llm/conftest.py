"""The real llama.cpp server, started once per test session the way `coevolve up` starts it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coevolve.shared.llm.run_server import start_for_run
from coevolve.shared.llm.server import LlamaServer, llama_cpp_installed


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    if not llama_cpp_installed():
        pytest.skip("llama_cpp is not importable: deploy/install.sh installs llama-cpp-python")
    run_dir = tmp_path_factory.mktemp("llm-run")
    # a short context keeps the KV cache small; the roles' test prompts fit in it
    server = start_for_run({"server": {"n_ctx": 4096}}, run_dir)
    assert server is not None
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def on_server(llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's process (and the services it starts) finds the server as services do:
    through the environment."""
    for name, value in llama_server.environment().items():
        monkeypatch.setenv(name, value)
