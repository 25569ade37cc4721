"""The local llama.cpp server of the benchmarks that measure LLM roles: started for the
benchmark with the model it names, each role's client pointed at it, stopped at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from coevolve.shared.llm import LlamaServer, OpenAIBackend, Role, RoleLLM, ServerSettings
from coevolve.shared.llm.roles import local_endpoint, role_settings


def local_role(server: LlamaServer, role: Role, section: dict[str, Any] | None = None) -> RoleLLM:
    """``role``'s client for ``server``, with the role's settings from an ``llm`` config
    section (None: the embedded defaults, as a default run has them)."""
    settings = role_settings(section)[role]
    endpoint = local_endpoint(settings, server.base_url, server.api_key, server.alias)
    return RoleLLM(role, OpenAIBackend(endpoint), settings)


@asynccontextmanager
async def served_roles(
    settings: ServerSettings,
    roles: Sequence[Role],
    run_dir: Path,
    section: dict[str, Any] | None = None,
) -> AsyncIterator[dict[Role, RoleLLM]]:
    """One server for the block (its log in ``run_dir/logs/llm.log``) and a client per
    role on it; the clients are closed and the server stopped when the block ends."""
    server = LlamaServer(settings, log_file=run_dir / "logs" / "llm.log")
    await asyncio.to_thread(server.start)
    clients = {role: local_role(server, role, section) for role in roles}
    try:
        yield clients
    finally:
        for llm in clients.values():
            await llm.client.aclose()
        await asyncio.to_thread(server.stop)
