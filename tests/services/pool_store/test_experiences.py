"""The distiller's experiences in the pool-store file: kept once with their lineage, and
put into the rollout jobs of similar tasks."""

from __future__ import annotations

from pathlib import Path

from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import keep_experience, rollout_jobs
from coevolve.services.pool_store.sampling import SamplingConfig
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Experience, Task
from tests.services.pool_store.conftest import TaskFactory


def experience(task: Task, text: str, number: int = 0) -> Experience:
    return Experience(
        id=f"exp-{task.id}-{number}",
        text=text,
        task_id=task.id,
        environment=task.environment,
        request="\n".join(task.user_turns),
        group_id=f"group-{number}",
        trajectory_ids=["best", "worst"],
        rewards=[1.0, 0.0],
        policy_version=3,
        functions=["mv"],
    )


def test_an_experience_is_kept_once_with_its_lineage_across_a_reopen(
    db_path: Path, make_task: TaskFactory
) -> None:
    task = make_task()
    kept = experience(task, "Call cd into the folder before mv.")
    with PoolStore(db_path) as store:
        assert keep_experience(store, kept)
        assert not keep_experience(store, kept)  # a redelivery
    with PoolStore.open_readonly(db_path) as store:
        assert store.experiences() == [kept]
        assert store.experiences()[0].trajectory_ids == ["best", "worst"]


def test_jobs_carry_the_experiences_of_similar_requests_and_count_them(
    store: PoolStore, make_task: TaskFactory
) -> None:
    moving = make_task(user_turns=["Move report_1.txt into the archive folder."])
    unrelated = make_task(user_turns=["Buy 100 shares of NVDA at the market price."])
    store.add_tasks([moving, unrelated])
    similar = make_task(user_turns=["Move report_9.txt into the archive folder."])
    keep_experience(store, experience(similar, "Call cd into the folder before mv."))
    keep_experience(store, experience(unrelated, "Check the price with get_stock_info first."))

    config = PoolStoreConfig(
        sampling=SamplingConfig(sampler="uniform"), experiences_per_job=2, group_size=4
    )
    jobs = rollout_jobs(store, 2, config, queue_seq=1, first_round=0)
    carried = {job.task.id: [e.text for e in job.experiences] for job in jobs}
    assert carried[moving.id] == ["Call cd into the folder before mv."]
    assert carried[unrelated.id] == ["Check the price with get_stock_info first."]
    assert store.experience_uses() == {
        f"exp-{similar.id}-0": 1,
        f"exp-{unrelated.id}-0": 1,
    }


def test_no_experience_is_carried_below_the_similarity_floor(
    store: PoolStore, make_task: TaskFactory
) -> None:
    task = make_task(user_turns=["Move report_1.txt into the archive folder."])
    store.add_tasks([task])
    other = make_task(user_turns=["Post a tweet saying hello to everyone."])
    keep_experience(store, experience(other, "Authenticate with the Twitter API first."))
    config = PoolStoreConfig(sampling=SamplingConfig(sampler="uniform"))
    (job,) = rollout_jobs(store, 1, config, queue_seq=1, first_round=0)
    assert job.experiences == []
    assert store.experience_uses() == {f"exp-{other.id}-0": 0}
