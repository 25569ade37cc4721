"""A run with no labels on real services: pool-store seeds from the committed D0, the
learner warm-starts on D0's calls and publishes a policy, and rollout trains on D0 tasks;
no task in the pool and no learner input carries a BFCL question or answer."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from coevolve.shared.config import Settings
from coevolve.shared.messages import Task
from coevolve.shared.task_sets import load_d0
from tests.integration.conftest import loop_settings  # noqa: F401  (fixture)
from tests.nolabels.conftest import carries_labels
from tests.nolabels.services_harness import until_first_group

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_no_labels_run_warm_starts_on_d0_and_publishes_a_policy(
    loop_settings: Settings,  # noqa: F811
    committed_d0: Path,
) -> None:
    loop_settings.labels = "none"
    loop_settings.d0.file = str(committed_d0)
    d0_ids = {task.id for task in load_d0(committed_d0).tasks}
    first = await until_first_group(loop_settings, demo_tasks=3)
    assert first.announced_version == 1
    assert loop_settings.path("policies", "v1.safetensors").is_file()
    payload = torch.load(first.learner.checkpoint, weights_only=True)
    assert payload["extra"]["warm_started"] is True
    kept = loop_settings.path("checkpoints", "demonstrations.tasks.json").read_bytes()
    replayed = msgspec.json.decode(kept, type=list[Task])
    assert len(replayed) == 3 and {t.id for t in replayed} <= d0_ids
    assert all(carries_labels(task) == [] for task in replayed)
    origins = {k: n for k, n in first.pool.tasks_by_origin.items() if n}
    assert origins == {"explored": len(d0_ids)} and first.pool.results >= 1
    assert first.tasks and {t.id for t in first.tasks} <= d0_ids
    assert all(carries_labels(task) == [] for task in first.tasks)
