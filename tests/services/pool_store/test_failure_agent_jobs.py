"""Pool-store's jobs for the co-evolving failure agent: a share of the jobs, each on a
task the target failed in its latest group, on a real DuckDB file."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import failure_agent_job, rollout_jobs
from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import RolloutJob, RolloutResults, ScoreSample, Task
from tests.services.pool_store.conftest import TaskFactory


def record(store: PoolStore, group: str, task: Task, scores: list[float]) -> None:
    samples = [
        ScoreSample(
            task_id=task.id, policy_version=1, score=s, length=10, generate_s=0.1, environment_s=0.0
        )
        for s in scores
    ]
    assert store.record_results(RolloutResults(group_id=group, samples=samples))
    time.sleep(0.01)  # the next group is recorded later


def jobs(store: PoolStore, share: float) -> list[RolloutJob]:
    config = PoolStoreConfig(sampling=SamplingConfig(sampler="uniform"), failure_agent_share=share)
    return [job for seq in range(12) for job in rollout_jobs(store, 4, config, seq, 0)]


def test_failure_agent_jobs_are_a_share_of_the_jobs_on_tasks_the_target_failed(
    store: PoolStore, make_task: TaskFactory
) -> None:
    solved, failed, unseen = make_task(), make_task(), make_task()
    store.add_tasks([solved, failed, unseen])
    record(store, "g1", solved, [1.0, 1.0])
    record(store, "g2", failed, [1.0, 0.4])
    assert [t.id for t in store.failed_tasks(8)] == [failed.id]

    made = jobs(store, 0.5)
    agents = Counter(job.agent for job in made)
    assert 0.25 * len(made) < agents["failure"] < 0.75 * len(made)
    assert {job.task.id for job in made if job.agent == "failure"} == {failed.id}
    assert all(not job.experiences for job in made if job.agent == "failure")
    # a job re-fed under its id gets the same answer
    config, fed = PoolStoreConfig(failure_agent_share=0.5), jobs(store, 0.0)

    def answers() -> list[str | None]:
        handed = (failure_agent_job(job, [failed], config) for job in fed)
        return [None if job is None else job.id for job in handed]

    assert answers() == answers() and any(answers())
    assert {job.agent for job in jobs(store, 0.0)} == {"target"}

    record(store, "g3", failed, [1.0, 1.0])  # its latest group solved it
    assert store.failed_tasks(8) == []
    assert {job.agent for job in jobs(store, 0.5)} == {"target"}


def test_the_share_is_checked() -> None:
    for wrong in (-0.1, 1.0):
        with pytest.raises(ValueError, match="failure_agent_share"):
            PoolStoreConfig(failure_agent_share=wrong)
