"""PoolStore: the task pool, rollout results and verdicts in one DuckDB file.

The store is synchronous and the only writer of its file. One connection serves every
call, guarded by a lock, so the actor may call it from worker threads. Every write is one
transaction; an idempotency table (``processed_messages``) lets a handler record "this
message id is done" in the same transaction as its effect.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import duckdb
import msgspec

from coevolve.services.pool_store.sampling import (
    OriginDraw,
    PoolCounts,
    origin_quotas,
    origin_weights,
)
from coevolve.services.pool_store.schema import (
    SCHEMA_VERSION,
    STATEMENTS,
    TASK_COLUMNS,
    origin_key_range,
)
from coevolve.shared.messages import (
    ORIGINS,
    ExplorationContext,
    Lineage,
    PoolStats,
    RolloutResults,
    ScoreSample,
    Task,
    TaskStatus,
    ToolCall,
    Verdict,
)

T = TypeVar("T")

# DuckDB answers ``key IN (<literal list>)`` through the unique index only up to
# index_scan_max_count (2048) keys and only without other predicates; a prepared
# parameter list or an extra filter turns it into a table scan (5-10x slower at 1M rows).
_KEY_CHUNK: Final = 1000
_MAX_DRAW_ROUNDS: Final = 6

# One writable PoolStore per file per process: the in-memory PoolCounts are only right
# if nothing else writes the file (DuckDB's lock covers other processes).
_open_files: set[Path] = set()
_open_files_lock = threading.Lock()

_TASK_SELECT: Final = ", ".join(TASK_COLUMNS)
_RESULTS_HANDLER: Final = "rollout_results"

_json_encoder = msgspec.json.Encoder()
_turns_decoder = msgspec.json.Decoder(list[str])
_state_decoder = msgspec.json.Decoder(dict[str, Any])
_ground_truth_decoder = msgspec.json.Decoder(list[list[ToolCall]])
_lineage_decoder = msgspec.json.Decoder(Lineage)
_reasons_decoder = msgspec.json.Decoder(list[str])
_criteria_decoder = msgspec.json.Decoder(dict[str, bool])


class ReadOnlyStoreError(RuntimeError):
    """A write was attempted on a store opened with ``PoolStore.open_readonly``."""


def _json(value: object) -> str:
    return _json_encoder.encode(value).decode()


def _task_from_row(row: Sequence[Any]) -> Task:
    (
        task_id,
        _content_hash,
        environment,
        user_turns,
        initial_state,
        ground_truth,
        env_config,
        origin,
        description,
        source_entry,
        lineage,
        status,
        created_at,
    ) = row
    return Task(
        id=task_id,
        environment=environment,
        user_turns=_turns_decoder.decode(user_turns),
        initial_state=_state_decoder.decode(initial_state),
        ground_truth=_ground_truth_decoder.decode(ground_truth),
        env_config=_state_decoder.decode(env_config),
        origin=origin,
        description=description,
        source_entry=source_entry,
        lineage=_lineage_decoder.decode(lineage),
        status=status,
        created_at=created_at,
    )


def _placeholders(count: int) -> str:
    return ", ".join("?" * count)


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Transaction:
    """The open transaction handed to ``PoolStore.run_once`` effects."""

    def __init__(self, connection: duckdb.DuckDBPyConnection, counts: PoolCounts) -> None:
        self._connection = connection
        # the pool counts as they will be once this transaction commits
        self.counts = counts

    def execute(self, sql: str, params: Sequence[object] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement inside the transaction and return its rows (if any)."""
        cursor = self._connection.execute(sql, params)
        return cursor.fetchall() if cursor.description else []

    def is_processed(self, message_id: str) -> bool:
        rows = self._connection.execute(
            "SELECT 1 FROM processed_messages WHERE message_id = ?", [message_id]
        ).fetchall()
        return bool(rows)

    def mark_processed(self, message_ids: Sequence[str], handler: str) -> None:
        unique_ids = list(dict.fromkeys(message_ids))
        self._connection.execute(
            "INSERT INTO processed_messages SELECT unnest(?::VARCHAR[]), ?, ?",
            [unique_ids, handler, time.time()],
        )

    def claim(self, message_id: str, handler: str) -> bool:
        """Record ``message_id`` as processed; False when it already was."""
        if self.is_processed(message_id):
            return False
        self.mark_processed([message_id], handler)
        return True


class PoolStore:
    """The task pool in a DuckDB file. One instance per file; it is the only writer."""

    def __init__(self, path: Path | str, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self._file_key = self.path.resolve()
        self.read_only = read_only
        self._lock = threading.RLock()
        self._closed = False
        self._counts = PoolCounts()
        if read_only:
            if not self.path.exists():
                raise FileNotFoundError(f"no pool-store file at {self.path}")
            self._connection = duckdb.connect(str(self.path), read_only=True)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._claim_file()
            try:
                self._connection = duckdb.connect(str(self.path))
            except BaseException:
                self._release_file()
                raise
        try:
            # DuckDB draws a progress bar on stderr for slow queries: noise in service logs
            self._connection.execute("SET enable_progress_bar = false")
            if not read_only:
                self._create_schema()
            self._check_schema_version()
            self._counts = self._load_counts()
        except BaseException:
            self.close()
            raise

    @classmethod
    def open_readonly(cls, path: Path | str) -> PoolStore:
        """Open for inspection (CLI); fails while a writer holds the file's lock."""
        return cls(path, read_only=True)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._connection.close()
            if not self.read_only:
                self._release_file()

    def _claim_file(self) -> None:
        with _open_files_lock:
            if self._file_key in _open_files:
                raise RuntimeError(f"{self.path} is already open for writing in this process")
            _open_files.add(self._file_key)

    def _release_file(self) -> None:
        with _open_files_lock:
            _open_files.discard(self._file_key)

    def _load_counts(self) -> PoolCounts:
        counts = PoolCounts()
        rows = self._connection.execute(
            "SELECT origin, environment, count(*) FILTER (WHERE status = 'active'), "
            "max(sample_key) FROM tasks GROUP BY origin, environment"
        ).fetchall()
        for origin, environment, active, max_key in rows:
            low, _ = origin_key_range(origin)
            counts.used_keys[origin] = max(counts.used_keys[origin], int(max_key) - low + 1)
            counts.active[(origin, environment)] = int(active)
        return counts

    def __enter__(self) -> PoolStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _create_schema(self) -> None:
        with self._transaction() as tx:
            for statement in STATEMENTS:
                tx.execute(statement)
            rows = tx.execute("SELECT value FROM meta WHERE key = 'schema_version'")
            if not rows:
                tx.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        self._check_schema_version()

    def _check_schema_version(self) -> None:
        rows = self._connection.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'"
        ).fetchall()
        if not rows:
            raise ValueError(f"{self.path} is not a pool-store file (no schema_version)")
        found = int(rows[0][0])
        if found > SCHEMA_VERSION:
            raise ValueError(
                f"{self.path} has pool-store schema {found}, newer than supported {SCHEMA_VERSION}"
            )

    @contextmanager
    def _transaction(self) -> Iterator[Transaction]:
        if self.read_only:
            raise ReadOnlyStoreError(f"pool store {self.path} is open read-only")
        with self._lock:
            tx = Transaction(self._connection, self._counts.copy())
            self._connection.begin()
            try:
                yield tx
                self._connection.commit()
            except BaseException:
                self._rollback()
                raise
            self._counts = tx.counts

    def _rollback(self) -> None:
        # a failed commit has already ended the transaction
        with suppress(duckdb.TransactionException):
            self._connection.rollback()

    def _query(self, sql: str, params: Sequence[object] | None = None) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._connection.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ idempotency

    def processed(self, message_id: str) -> bool:
        """Whether any handler has committed its effect for ``message_id``."""
        return bool(
            self._query("SELECT 1 FROM processed_messages WHERE message_id = ?", [message_id])
        )

    def run_once(
        self, message_id: str, handler: str, effect: Callable[[Transaction], T]
    ) -> tuple[bool, T | None]:
        """Run ``effect`` and record ``message_id`` in one transaction, unless already done.

        Returns (True, effect's result) the first time, (False, None) on a redelivery.
        The effect must not write ``tasks`` itself (use add_tasks or record_verdict): the
        store keeps the counts that sampling relies on in memory.
        """
        with self._transaction() as tx:
            if not tx.claim(message_id, handler):
                return False, None
            return True, effect(tx)

    # ------------------------------------------------------------------ tasks

    def add_tasks(self, tasks: Sequence[Task]) -> tuple[list[str], list[str]]:
        """Add tasks not yet in the pool (by content hash); return (added, duplicate) ids.

        A task whose id is taken by a task with different content is an error and
        nothing of the call is written.
        """
        with self._transaction() as tx:
            added, duplicates = self._insert_tasks(tx, tasks)
        return [task.id for task, _ in added], duplicates

    def _insert_tasks(
        self, tx: Transaction, tasks: Sequence[Task]
    ) -> tuple[list[tuple[Task, str]], list[str]]:
        """Insert inside ``tx``; returns ((task, hash) added, ids of duplicates)."""
        hashes = [task.content_hash() for task in tasks]
        known_by_hash = self._known(tx, "content_hash", "id", hashes)
        known_by_id = self._known(tx, "id", "content_hash", [task.id for task in tasks])
        added: list[tuple[Task, str]] = []
        duplicates: list[str] = []
        for task, content_hash in zip(tasks, hashes, strict=True):
            if content_hash in known_by_hash:
                duplicates.append(task.id)
                continue
            if task.id in known_by_id:
                raise ValueError(
                    f"task id {task.id!r} already names a different task "
                    f"(content hash {known_by_id[task.id][:12]}...)"
                )
            known_by_hash[content_hash] = task.id
            known_by_id[task.id] = content_hash
            added.append((task, content_hash))
        if added:
            self._write_task_rows(tx, added)
        return added, duplicates

    @staticmethod
    def _known(tx: Transaction, column: str, other: str, values: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for chunk in _chunks(list(dict.fromkeys(values)), _KEY_CHUNK):
            rows = tx.execute(
                f"SELECT {column}, {other} FROM tasks WHERE {column} IN "
                f"({_placeholders(len(chunk))})",
                list(chunk),
            )
            found.update((key, value) for key, value in rows)
        return found

    @staticmethod
    def _write_task_rows(tx: Transaction, rows: Sequence[tuple[Task, str]]) -> None:
        keys: list[int] = []
        for task, _ in rows:
            low, _ = origin_key_range(task.origin)
            keys.append(low + tx.counts.used_keys[task.origin])
            tx.counts.used_keys[task.origin] += 1
            if task.status == "active":
                tx.counts.active[(task.origin, task.environment)] += 1
        tasks = [task for task, _ in rows]
        tx.execute(
            f"INSERT INTO tasks ({_TASK_SELECT}, sample_key) SELECT "
            "unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), "
            "unnest(?::VARCHAR[])::JSON, unnest(?::VARCHAR[])::JSON, "
            "unnest(?::VARCHAR[])::JSON, unnest(?::VARCHAR[])::JSON, "
            "unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), "
            "unnest(?::VARCHAR[])::JSON, unnest(?::VARCHAR[]), unnest(?::DOUBLE[]), "
            "unnest(?::BIGINT[])",
            [
                [task.id for task in tasks],
                [content_hash for _, content_hash in rows],
                [task.environment for task in tasks],
                [_json(task.user_turns) for task in tasks],
                [_json(task.initial_state) for task in tasks],
                [_json(task.ground_truth) for task in tasks],
                [_json(task.env_config) for task in tasks],
                [task.origin for task in tasks],
                [task.description for task in tasks],
                [task.source_entry for task in tasks],
                [_json(task.lineage) for task in tasks],
                [task.status for task in tasks],
                [task.created_at for task in tasks],
                keys,
            ],
        )

    def get_task(self, task_id: str) -> Task | None:
        rows = self._query(f"SELECT {_TASK_SELECT} FROM tasks WHERE id = ?", [task_id])
        return _task_from_row(rows[0]) if rows else None

    def list_tasks(
        self, origin: str | None = None, limit: int = 50, environment: str | None = None
    ) -> list[Task]:
        """The newest tasks first, optionally of one origin and environment."""
        conditions, params = self._filters(origin=origin, environment=environment)
        rows = self._query(
            f"SELECT {_TASK_SELECT} FROM tasks {conditions} ORDER BY created_at DESC, id LIMIT ?",
            [*params, limit],
        )
        return [_task_from_row(row) for row in rows]

    def set_status(self, task_ids: Sequence[str], status: TaskStatus) -> int:
        """Set the status of tasks (retired tasks are never sampled); returns rows changed."""
        if status not in ("active", "retired"):
            raise ValueError(f"unknown task status {status!r}")
        changed = 0
        with self._transaction() as tx:
            for chunk in _chunks(list(dict.fromkeys(task_ids)), _KEY_CHUNK):
                rows = tx.execute(
                    f"UPDATE tasks SET status = ? WHERE status <> ? AND id IN "
                    f"({_placeholders(len(chunk))}) RETURNING origin, environment",
                    [status, status, *chunk],
                )
                for origin, environment in rows:
                    tx.counts.active[(origin, environment)] += 1 if status == "active" else -1
                changed += len(rows)
        return changed

    @staticmethod
    def _filters(
        origin: str | None = None, environment: str | None = None, active_only: bool = False
    ) -> tuple[str, list[object]]:
        conditions: list[str] = []
        params: list[object] = []
        if origin is not None:
            conditions.append("origin = ?")
            params.append(origin)
        if environment is not None:
            conditions.append("environment = ?")
            params.append(environment)
        if active_only:
            conditions.append("status = 'active'")
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        return where, params

    # ------------------------------------------------------------------ sampling

    def sample_batch(
        self,
        size: int,
        mix: dict[str, float] | None = None,
        environment: str | None = None,
        seed: int | None = None,
    ) -> list[Task]:
        """Draw ``size`` active tasks, mixing origins by ``mix`` weights.

        ``mix`` maps origin -> weight (origins left out get 0); the weights are
        renormalised over the origins that have matching active tasks. ``None`` or ``{}``
        draws every matching task with equal probability. Within an origin tasks are
        drawn without replacement; only when an origin has fewer tasks than its share
        of the batch are some repeated. Returns [] when no task matches.
        """
        if size < 0:
            raise ValueError(f"batch size must be >= 0, got {size}")
        rng = random.Random(seed)
        with self._lock:
            counts = self._counts
            available = {o: counts.active_in(o, environment) for o in counts.used_keys}
            weights = origin_weights(mix, available)
            if size == 0 or not weights:
                return []
            quotas = origin_quotas(weights, size, rng)
            draws = [
                OriginDraw(
                    origin,
                    origin_key_range(origin)[0],
                    need=min(quota, available[origin]),
                    active=available[origin],
                    used=counts.used_keys[origin],
                    rng=rng,
                )
                for origin, quota in quotas.items()
            ]
            tasks = self._draw_tasks(draws, environment)
        batch: list[Task] = []
        for draw in draws:
            picked = [tasks[key] for key in draw.picked]
            batch.extend(picked)
            batch.extend(rng.choices(picked, k=quotas[draw.origin] - len(picked)))
        rng.shuffle(batch)
        return batch

    def _draw_tasks(self, draws: Sequence[OriginDraw], environment: str | None) -> dict[int, Task]:
        """Run the draws against the table; returns the picked tasks by sample key.

        Drawn keys are first checked on the narrow columns (status, environment) and only
        the picked ones fetched whole: fetching a row costs one lookup per column.
        """
        for draw in draws:
            if draw.wants_listing:
                draw.pick_from(self._matching_keys(draw.origin, environment))
        for _ in range(_MAX_DRAW_ROUNDS):
            wanted = {draw: draw.next_keys() for draw in draws if not draw.done}
            if not wanted:
                break
            exact = [key for draw, keys in wanted.items() if draw.exact for key in keys]
            checked = [key for draw, keys in wanted.items() if not draw.exact for key in keys]
            matching = set(exact) | self._keys_matching(checked, environment)
            for draw, keys in wanted.items():
                draw.keep([key for key in keys if key in matching])
        for draw in draws:
            if not draw.done:
                draw.pick_from(self._matching_keys(draw.origin, environment))
        return self._fetch_by_keys([key for draw in draws for key in draw.picked])

    def _keys_matching(self, keys: Sequence[int], environment: str | None) -> set[int]:
        """Those of ``keys`` whose task is active (and in ``environment``)."""
        matching: set[int] = set()
        for chunk in _chunks(keys, _KEY_CHUNK):
            # literal integers: see _KEY_CHUNK for why not parameters
            literal = ", ".join(str(int(key)) for key in chunk)
            rows = self._connection.execute(
                f"SELECT sample_key, status, environment FROM tasks WHERE sample_key IN ({literal})"
            ).fetchall()
            matching.update(
                int(key)
                for key, status, env in rows
                if status == "active" and environment in (None, env)
            )
        return matching

    def _matching_keys(self, origin: str, environment: str | None) -> list[int]:
        conditions, params = self._filters(origin=origin, environment=environment, active_only=True)
        rows = self._connection.execute(
            f"SELECT sample_key FROM tasks {conditions} ORDER BY sample_key", params
        ).fetchall()
        return [int(key) for (key,) in rows]

    def _fetch_by_keys(self, keys: Sequence[int]) -> dict[int, Task]:
        found: dict[int, Task] = {}
        for chunk in _chunks(keys, _KEY_CHUNK):
            # literal integers: see _KEY_CHUNK for why not parameters
            literal = ", ".join(str(int(key)) for key in chunk)
            rows = self._connection.execute(
                f"SELECT sample_key, {_TASK_SELECT} FROM tasks WHERE sample_key IN ({literal})"
            ).fetchall()
            found.update((int(row[0]), _task_from_row(row[1:])) for row in rows)
        return found

    # ------------------------------------------------------------------ results

    def record_results(self, results: RolloutResults) -> bool:
        """Store a group's scores once; False when this message or group is already in."""
        group_key = f"group:{results.group_id}"
        with self._transaction() as tx:
            if tx.is_processed(results.id) or tx.is_processed(group_key):
                return False
            samples = results.samples
            if samples:
                tx.execute(
                    "INSERT INTO rollout_results SELECT ?, unnest(?::INTEGER[]), ?, "
                    "unnest(?::VARCHAR[]), unnest(?::INTEGER[]), unnest(?::DOUBLE[]), "
                    "unnest(?::INTEGER[]), unnest(?::DOUBLE[]), unnest(?::DOUBLE[]), ?",
                    [
                        results.group_id,
                        list(range(len(samples))),
                        results.id,
                        [s.task_id for s in samples],
                        [s.policy_version for s in samples],
                        [s.score for s in samples],
                        [s.length for s in samples],
                        [s.generate_s for s in samples],
                        [s.environment_s for s in samples],
                        time.time(),
                    ],
                )
            tx.mark_processed([results.id, group_key], _RESULTS_HANDLER)
        return True

    def score_history(self, task_id: str) -> list[ScoreSample]:
        """Every recorded score of a task, oldest first."""
        rows = self._query(
            "SELECT task_id, policy_version, score, length, generate_s, environment_s "
            "FROM rollout_results WHERE task_id = ? "
            "ORDER BY recorded_at, group_id, sample_index",
            [task_id],
        )
        return [
            ScoreSample(
                task_id=row[0],
                policy_version=row[1],
                score=row[2],
                length=row[3],
                generate_s=row[4],
                environment_s=row[5],
            )
            for row in rows
        ]

    # ------------------------------------------------------------------ verdicts

    def record_verdict(self, verdict: Verdict) -> tuple[bool, str | None]:
        """Store a verdict once and, when accepted, add its task with the lineage.

        Returns (new_verdict, added_task_id). On a redelivered verdict new_verdict is
        False and added_task_id is the task it added the first time (if any), so a caller
        may republish its task-added event idempotently. An accepted task whose content is
        already in the pool is stored as a verdict but adds nothing (added_task_id None).
        """
        lineage = msgspec.structs.replace(
            verdict.task.lineage,
            candidate_id=verdict.task.lineage.candidate_id or verdict.candidate_id,
            verdict_id=verdict.id,
        )
        task = msgspec.structs.replace(verdict.task, lineage=lineage)
        with self._transaction() as tx:
            previous = tx.execute(
                "SELECT pool_task_id, added FROM verdicts WHERE id = ?", [verdict.id]
            )
            if previous:
                pool_task_id, was_added = previous[0]
                return False, pool_task_id if was_added else None
            added_task_id: str | None = None
            pool_task_id = None
            if verdict.accepted:
                added, _ = self._insert_tasks(tx, [task])
                if added:
                    added_task_id = pool_task_id = task.id
                else:
                    pool_task_id = self._known(tx, "content_hash", "id", [task.content_hash()]).get(
                        task.content_hash()
                    )
            tx.execute(
                "INSERT INTO verdicts VALUES (?, ?, ?, ?::JSON, ?::JSON, ?, ?, ?, ?, ?, ?, ?, ?, "
                "?, ?, ?, ?::JSON, ?::JSON, ?, ?)",
                [
                    verdict.id,
                    verdict.candidate_id,
                    verdict.accepted,
                    _json(verdict.reasons),
                    _json(verdict.criteria),
                    task.id,
                    task.content_hash(),
                    task.origin,
                    task.environment,
                    added_task_id is not None,
                    pool_task_id,
                    lineage.signal_id,
                    lineage.signal_kind,
                    lineage.exploration_id,
                    lineage.exploration_mode,
                    lineage.trace_id,
                    _json(lineage),
                    _json(task),
                    verdict.created_at,
                    time.time(),
                ],
            )
        return True, added_task_id

    # ------------------------------------------------------------------ reports

    def stats(self) -> PoolStats:
        with self._lock:
            by_origin: dict[str, int] = dict.fromkeys(ORIGINS, 0)
            by_origin.update(
                (origin, int(count))
                for origin, count in self._connection.execute(
                    "SELECT origin, count(*) FROM tasks GROUP BY origin"
                ).fetchall()
            )
            (results,) = self._connection.execute(
                "SELECT count(*) FROM rollout_results"
            ).fetchall()[0]
            accepted, rejected = self._connection.execute(
                "SELECT count(*) FILTER (WHERE accepted), count(*) FILTER (WHERE NOT accepted) "
                "FROM verdicts"
            ).fetchall()[0]
        return PoolStats(
            tasks_by_origin=by_origin,
            results=int(results),
            accepted_candidates=int(accepted),
            rejected_candidates=int(rejected),
        )

    def lineage(self, task_id: str) -> dict[str, Any]:
        """The chain signal -> context -> exploration -> candidate -> verdict of a task.

        Empty when the task is unknown; a seed task has no signal, exploration or verdict.
        """
        task = self.get_task(task_id)
        if task is None:
            return {}
        chain = task.lineage
        verdict_rows = self._query(
            "SELECT id, accepted, reasons, criteria, created_at FROM verdicts "
            "WHERE id = ? OR (added AND pool_task_id = ?) "
            "ORDER BY (id = ?) DESC LIMIT 1",
            [chain.verdict_id, task_id, chain.verdict_id],
        )
        verdict: dict[str, Any] | None = None
        if verdict_rows:
            verdict_id, accepted, reasons, criteria, created_at = verdict_rows[0]
            verdict = {
                "id": verdict_id,
                "accepted": accepted,
                "reasons": _reasons_decoder.decode(reasons),
                "criteria": _criteria_decoder.decode(criteria),
                "created_at": created_at,
            }
        return {
            "task_id": task.id,
            "origin": task.origin,
            "environment": task.environment,
            "description": task.description,
            "created_at": task.created_at,
            "trace_id": chain.trace_id,
            "signal": None
            if chain.signal_id is None
            else {
                "id": chain.signal_id,
                "kind": chain.signal_kind,
                "evidence": chain.signal_evidence,
                "parent_task_id": chain.parent_task_id,
            },
            "context": None if chain.context is None else _context_dict(chain.context),
            "exploration": None
            if chain.exploration_id is None
            else {
                "id": chain.exploration_id,
                "mode": chain.exploration_mode,
                "steps": chain.exploration_steps,
            },
            "candidate": None if chain.candidate_id is None else {"id": chain.candidate_id},
            "verdict": verdict,
        }


def _context_dict(context: ExplorationContext) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.to_builtins(context)
    return result
