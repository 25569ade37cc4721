"""``abstract`` over a real pool file of the seed tasks and a scripted LLM on loopback."""

from __future__ import annotations

from pathlib import Path

from coevolve.schedules.synthesis import PoolFile
from coevolve.services.abstractor.config import AbstractorConfig
from coevolve.services.abstractor.handler import Abstraction, AbstractorDeps, abstract
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import RoleClients
from coevolve.shared.messages import Exploration
from tests.support.fake_llm import Brain, RoleFakeLLM


async def abstracted(
    tmp_path: Path, brain: Brain, explored: Exploration
) -> tuple[Abstraction, RoleFakeLLM]:
    """``explored`` abstracted with ``brain`` answering every role; the endpoint is
    returned stopped, with its counts."""
    fake = RoleFakeLLM(brain).start()
    clients = RoleClients.from_section(fake.llm_section(), tmp_path)
    config = AbstractorConfig(max_tasks=5, leak_backend="ngram", rewrites=1)
    try:
        with PoolStore(tmp_path / "pool.duckdb") as store:
            store.add_tasks(seed_tasks())
            deps = AbstractorDeps(clients["abstractor"], config, PoolFile(store), tmp_path)
            return await abstract(explored, deps), fake
    finally:
        await clients.aclose()
        fake.stop()
