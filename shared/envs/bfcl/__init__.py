"""BFCL multi-turn: every API class of ``bfcl_eval`` behind the environment protocol."""

from coevolve.shared.envs.bfcl.environment import BfclEnvironment
from coevolve.shared.envs.bfcl.tasks import (
    MULTI_TURN_CATEGORIES,
    SUITES,
    TURN_SUITES,
    eval_queries,
    grain_of,
    load_tasks,
    load_turn_tasks,
    seed_pool,
    seed_tasks,
    split_of,
    split_tasks,
    suite_tasks,
    turn_tasks,
)

__all__ = [
    "MULTI_TURN_CATEGORIES",
    "SUITES",
    "TURN_SUITES",
    "BfclEnvironment",
    "eval_queries",
    "grain_of",
    "load_tasks",
    "load_turn_tasks",
    "seed_pool",
    "seed_tasks",
    "split_of",
    "split_tasks",
    "suite_tasks",
    "turn_tasks",
]
