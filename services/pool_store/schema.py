"""The DuckDB schema of the pool-store file (tables documented in docs/pool-store.md)."""

from __future__ import annotations

from typing import Final

from coevolve.shared.messages import ORIGINS

SCHEMA_VERSION: Final = 1

# sample_key = origin code << SAMPLE_KEY_SHIFT | per-origin sequence number (0, 1, 2, ...),
# dense per origin, so a uniform draw of keys is a uniform draw of that origin's tasks and
# the unique index turns a batch of drawn keys into one index scan.
SAMPLE_KEY_SHIFT: Final = 40
ORIGIN_CODES: Final[dict[str, int]] = {origin: code for code, origin in enumerate(ORIGINS)}


def origin_key_range(origin: str) -> tuple[int, int]:
    """The half-open range of sample keys that belong to ``origin``."""
    low = ORIGIN_CODES[origin] << SAMPLE_KEY_SHIFT
    return low, low + (1 << SAMPLE_KEY_SHIFT)


TASK_COLUMNS: Final = (
    "id",
    "content_hash",
    "environment",
    "user_turns",
    "initial_state",
    "ground_truth",
    "env_config",
    "origin",
    "description",
    "source_entry",
    "lineage",
    "status",
    "created_at",
)

STATEMENTS: Final = (
    """
    CREATE TABLE IF NOT EXISTS meta (
        key VARCHAR PRIMARY KEY,
        value VARCHAR NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS tasks (
        id VARCHAR PRIMARY KEY,
        content_hash VARCHAR NOT NULL UNIQUE,
        environment VARCHAR NOT NULL,
        user_turns JSON NOT NULL,
        initial_state JSON NOT NULL,
        ground_truth JSON NOT NULL,
        env_config JSON NOT NULL,
        origin VARCHAR NOT NULL CHECK (origin IN ('seed', 'explored', 'synthesized')),
        description VARCHAR NOT NULL,
        source_entry VARCHAR,
        lineage JSON NOT NULL,
        status VARCHAR NOT NULL CHECK (status IN ('active', 'retired')),
        created_at DOUBLE NOT NULL,
        sample_key BIGINT NOT NULL UNIQUE
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS rollout_results (
        group_id VARCHAR NOT NULL,
        sample_index INTEGER NOT NULL,
        message_id VARCHAR NOT NULL,
        task_id VARCHAR NOT NULL,
        policy_version INTEGER NOT NULL,
        score DOUBLE NOT NULL,
        length INTEGER NOT NULL,
        generate_s DOUBLE NOT NULL,
        environment_s DOUBLE NOT NULL,
        recorded_at DOUBLE NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS verdicts (
        id VARCHAR PRIMARY KEY,
        candidate_id VARCHAR NOT NULL,
        accepted BOOLEAN NOT NULL,
        reasons JSON NOT NULL,
        criteria JSON NOT NULL,
        task_id VARCHAR NOT NULL,
        content_hash VARCHAR NOT NULL,
        origin VARCHAR NOT NULL,
        environment VARCHAR NOT NULL,
        added BOOLEAN NOT NULL,
        pool_task_id VARCHAR,
        signal_id VARCHAR,
        signal_kind VARCHAR,
        exploration_id VARCHAR,
        exploration_mode VARCHAR,
        trace_id VARCHAR,
        lineage JSON NOT NULL,
        task JSON NOT NULL,
        created_at DOUBLE NOT NULL,
        recorded_at DOUBLE NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS experiences (
        id VARCHAR PRIMARY KEY,
        task_id VARCHAR NOT NULL,
        environment VARCHAR NOT NULL,
        text VARCHAR NOT NULL,
        body JSON NOT NULL,
        retrieved INTEGER NOT NULL,
        created_at DOUBLE NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS processed_messages (
        message_id VARCHAR PRIMARY KEY,
        handler VARCHAR NOT NULL,
        processed_at DOUBLE NOT NULL
    )
    """,
)
