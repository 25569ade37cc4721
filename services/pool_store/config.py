"""Pool-store's settings (the ``services.pool_store`` section)."""

from __future__ import annotations

import msgspec

from coevolve.services.pool_store.sampling import SamplingConfig, origin_weights


def default_seed_grains() -> dict[str, float]:
    # imported when needed: the BFCL task tables load bfcl_eval
    from coevolve.shared.envs.bfcl.tasks import DEFAULT_SEED_GRAINS

    return dict(DEFAULT_SEED_GRAINS)


def default_seed_classes() -> list[str]:
    from coevolve.shared.envs.bfcl.tasks import FOCUS_CLASSES

    return list(FOCUS_CLASSES)


class PoolStoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    db_file: str = "pool.duckdb"
    seed_environments: list[str] = msgspec.field(default_factory=lambda: ["bfcl"])
    # shares of per-turn tasks and whole entries in the seed pool (see seed_tasks_for)
    seed_grains: dict[str, float] = msgspec.field(default_factory=default_seed_grains)
    # the world: seed only BFCL entries whose API classes are all in this list (default: a
    # focused three-class world, see FOCUS_CLASSES); null: every class, the full BFCL world
    seed_classes: list[str] | None = msgspec.field(default_factory=default_seed_classes)
    # origin -> share of the jobs (and of sample replies that ask for no mix), e.g.
    # {seed: 0.5, explored: 0.25, synthesized: 0.25}; {} (the default): no per-origin
    # shares, every task is weighed by the sampler alone (see sampling.SamplingConfig)
    mix: dict[str, float] = msgspec.field(default_factory=dict)
    feed_jobs: bool = True
    # rollout jobs kept in the stream, the one rollout works on included: a fresh child
    # waits behind the others for its first draw (with 4 a queue took about two learner
    # steps to drain on 2 cores, runs 32-33). 1: rollout takes one job at a time, a group
    # takes tens of seconds and the feed refills within feed_interval_s
    job_queue_depth: int = 1
    group_size: int = 8
    feed_interval_s: float = 1.0
    # which tasks jobs and sample replies get: sampler (learnability | dynamic | uniform),
    # window, unseen_share, unseen_weight, uniform_weight, retire_after, max_task_share,
    # share_window, fresh_share (see sampling.SamplingConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    # self-navigating (the distiller's experiences): a rollout job carries up to this many
    # stored experiences whose request is at least this like its task's (n-gram cosine)
    experiences_per_job: int = 2
    experience_min_similarity: float = 0.3
    # the co-evolving failure agent (learner.grpo.preference.failure_agent): this share of
    # the jobs is rolled by it, each on one of the tasks the target failed most recently
    # (its latest group has a score below 1); 0: no failure-agent jobs
    failure_agent_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.failure_agent_share < 1.0:
            raise ValueError(
                f"pool_store.failure_agent_share must be in [0, 1), not {self.failure_agent_share}"
            )
        origin_weights(self.mix, {})  # unknown origins, negative or infinite weights raise
        if self.seed_classes is not None:
            from coevolve.shared.envs.bfcl.tasks import check_classes

            check_classes(self.seed_classes)
