"""BFCL multi-turn: every API class of ``bfcl_eval`` behind the environment protocol."""

from coevolve.shared.envs.bfcl.environment import BfclEnvironment
from coevolve.shared.envs.bfcl.tasks import (
    MULTI_TURN_CATEGORIES,
    SUITES,
    eval_queries,
    load_tasks,
    seed_tasks,
    split_of,
    split_tasks,
    suite_tasks,
)

__all__ = [
    "MULTI_TURN_CATEGORIES",
    "SUITES",
    "BfclEnvironment",
    "eval_queries",
    "load_tasks",
    "seed_tasks",
    "split_of",
    "split_tasks",
    "suite_tasks",
]
