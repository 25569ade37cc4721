"""The attributor role against the real llama.cpp server (the session fixture in
conftest.py, found through the environment as the services find it), greedy decoding:
it labels a group's steps, and a rollout worker with step credit on publishes them."""

from __future__ import annotations

from typing import Any

import pytest

from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.attribution import label_group, labels_fit
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.messages import RolloutJob
from coevolve.shared.structured import RejectionCounter
from tests.support.messages import NOTES_TASK, notes_group
from tests.support.rollout import published_group, rollout_settings

pytestmark = [pytest.mark.timeout(300), pytest.mark.anyio]

TASK = NOTES_TASK


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.usefixtures("on_server")
async def test_the_attributor_labels_every_step_of_a_group() -> None:
    clients = RoleClients(role_settings({"roles": {"attributor": {"temperature": 0.0}}}))
    counter = RejectionCounter()
    try:
        labelled = await label_group(notes_group(), TASK, clients["attributor"], counter)
    finally:
        await clients.aclose()
    assert counter.accepted == 2, counter.snapshot()
    assert [len(t.step_labels) for t in labelled.trajectories] == [3, 2]
    assert all(label in (-1, 1) for t in labelled.trajectories for label in t.step_labels)
    assert all(labels_fit(t) for t in labelled.trajectories)


@pytest.mark.usefixtures("on_server")
async def test_a_rollout_worker_with_step_credit_publishes_labelled_groups(
    settings: Settings,
) -> None:
    """The real worker end to end: NATS, the SmolLM2 engine, BFCL, the attributor."""
    llm: dict[str, Any] = {"roles": {"attributor": {"temperature": 0.0}}}
    rollout_settings(settings, {"enabled": True}, llm)
    actor = RolloutActor(settings)
    job = RolloutJob(task=seed_tasks()[0], group_size=2)
    published = await published_group(settings, actor, job)

    assert published.label_s > 0 and actor.step_credit_s == pytest.approx(published.label_s)
    # greedy, grammar-bound answers: each is one label per step, or refused and counted
    assert actor.attributions.accepted + actor.attributions.total_rejected == 2
    assert actor.attributions.accepted >= 1, actor.attributions.snapshot()
    assert any(labels_fit(t) for t in published.trajectories)
    assert all(labels_fit(t) or not t.step_labels for t in published.trajectories)
