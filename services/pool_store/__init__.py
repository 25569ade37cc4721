"""pool-store: the task pool, rollout results, verdicts and lineage in one DuckDB file."""
