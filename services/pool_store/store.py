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
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import duckdb
import msgspec

from coevolve.services.pool_store import experiences as experience_rows
from coevolve.services.pool_store.sampling import (
    FreshTasks,
    JobShares,
    OriginDraw,
    PoolCounts,
    RecentScores,
    SamplingConfig,
    TaskScores,
    fresh_slots,
    origin_quotas,
    origin_weights,
    split_slots,
    spread_unseen,
    unseen_probability,
    weighted_sample,
)
from coevolve.services.pool_store.schema import (
    SCHEMA_VERSION,
    STATEMENTS,
    TASK_COLUMNS,
    origin_key_range,
)
from coevolve.shared.messages import (
    ORIGINS,
    Experience,
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
# the origin of what the synthesis machinery makes: fresh until first fed as a job, as
# are the labelled turns the experiment's labelled_control arm adds (Lineage.labelled_control)
_FRESH_ORIGIN: Final = "synthesized"
_LABELLED_CONTROL: Final = "coalesce(json_extract(t.lineage, '$.labelled_control')::BOOLEAN, false)"

_json_encoder = msgspec.json.Encoder()
_turns_decoder = msgspec.json.Decoder(list[str])
_state_decoder = msgspec.json.Decoder(dict[str, Any])
_ground_truth_decoder = msgspec.json.Decoder(list[list[ToolCall]])
_lineage_decoder = msgspec.json.Decoder(Lineage)
_reasons_decoder = msgspec.json.Decoder(list[str])
_criteria_decoder = msgspec.json.Decoder(dict[str, bool])


class ReadOnlyStoreError(RuntimeError):
    """A write was attempted on a store opened with ``PoolStore.open_readonly``."""


@dataclass(frozen=True)
class UniformGroupShare:
    """How many recorded rollout groups had all rewards equal (no GRPO gradient)."""

    groups: int
    uniform: int

    @property
    def share(self) -> float | None:
        """uniform / groups; None when no group was recorded."""
        return self.uniform / self.groups if self.groups else None


@dataclass(frozen=True)
class SlotsToDraw:
    """What the sampler fills of one ``sample_batch``: ``size`` slots (those the fresh
    tasks left) among the origins ``weights`` gives a share (``mix`` as asked), with
    ``available`` tasks of each; ``skip``: keys already in the batch (fresh), not counted in
    ``available``; ``jobs``: the batch is a job feed."""

    size: int
    mix: dict[str, float] | None
    weights: dict[str, float]
    available: dict[str, int]
    environment: str | None
    rng: random.Random
    jobs: bool
    skip: frozenset[int]


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


def _ids_clause(column: str, task_ids: Sequence[str] | None) -> tuple[str, list[object]]:
    """``AND column IN (...)`` and its parameters for ``task_ids``; none for all tasks."""
    if task_ids is None:
        return "", []
    return f"AND {column} IN ({_placeholders(len(task_ids))})", list(task_ids)


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Transaction:
    """The open transaction handed to ``PoolStore.run_once`` effects."""

    def __init__(self, connection: duckdb.DuckDBPyConnection, counts: PoolCounts) -> None:
        self._connection = connection
        # the pool counts as they will be once this transaction commits
        self.counts = counts
        # the tasks written, with their sample keys, once it commits
        self.added: list[tuple[Task, int]] = []

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
    """The task pool in a DuckDB file. One instance per file; it is the only writer.

    ``sampling`` decides how ``sample_batch`` picks tasks and whether recorded results
    retire tasks (default: the learnability sampler with its defaults). A fresh task stays
    fresh while the newest policy version with results is at most ``fresh_versions`` past
    the one it answers (None: until it is fed).
    """

    def __init__(
        self,
        path: Path | str,
        *,
        read_only: bool = False,
        sampling: SamplingConfig | None = None,
        fresh_versions: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._file_key = self.path.resolve()
        self.read_only = read_only
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.fresh_versions = fresh_versions
        # the highest policy version among the recorded results
        self._newest_version = 0
        self._lock = threading.RLock()
        self._closed = False
        self._counts = PoolCounts()
        self._recent = RecentScores()
        self._shares = JobShares(self.sampling)
        self._fresh = FreshTasks()
        self._experiences: list[Experience] = []
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
            self._load_recent_scores()
            self._load_job_shares()
            self._newest_version = self._load_newest_version()
            self._load_fresh()
            self._experiences = self._load_experiences()
        except BaseException:
            self.close()
            raise

    @classmethod
    def open_readonly(cls, path: Path | str, sampling: SamplingConfig | None = None) -> PoolStore:
        """Open for inspection (CLI); fails while a writer holds the file's lock."""
        return cls(path, read_only=True, sampling=sampling)

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

    def _load_recent_scores(self, task_ids: Sequence[str] | None = None) -> None:
        """Rebuild the recent scores of active tasks from results: all, or those of
        ``task_ids`` (not empty; the caller has dropped their old scores).

        Only the last groups of each task matter: ``window`` groups hold at least
        ``window`` trajectories, and the solved streak needs ``retire_after`` of them.
        """
        groups_kept = max(self.sampling.window, self.sampling.retire_after, 1)
        id_filter, params = _ids_clause("r.task_id", task_ids)
        rows = self._connection.execute(
            f"""
            SELECT r.task_id, t.origin, t.environment, t.sample_key,
                   list(r.score ORDER BY r.sample_index)
            FROM rollout_results AS r JOIN tasks AS t ON t.id = r.task_id
            WHERE t.status = 'active' {id_filter}
            GROUP BY r.task_id, r.group_id, t.origin, t.environment, t.sample_key
            QUALIFY row_number() OVER (
                PARTITION BY r.task_id ORDER BY max(r.recorded_at) DESC, r.group_id DESC
            ) <= ?
            ORDER BY max(r.recorded_at), r.group_id
            """,
            [*params, groups_kept],
        ).fetchall()
        for task_id, origin, environment, sample_key, scores in rows:
            previous = self._recent.get(task_id) or TaskScores(
                origin=origin, environment=environment, sample_key=int(sample_key), recent=()
            )
            self._recent.put(task_id, previous.with_group(scores, self.sampling.window))

    def _load_job_shares(self) -> None:
        """Rebuild the window of jobs fed from the newest recorded groups (one group per
        job); jobs fed but not reported before the file was closed are not known."""
        kept = self.sampling.share_window - 1
        if kept < 1:
            return
        rows = self._connection.execute(
            """
            SELECT t.sample_key
            FROM (SELECT group_id, min(task_id) AS task_id, max(recorded_at) AS recorded
                  FROM rollout_results GROUP BY group_id
                  ORDER BY recorded DESC, group_id DESC LIMIT ?) AS g
            JOIN tasks AS t ON t.id = g.task_id
            ORDER BY g.recorded, g.group_id
            """,
            [kept],
        ).fetchall()
        self._shares.record([int(key) for (key,) in rows])

    def _load_newest_version(self) -> int:
        rows = self._connection.execute(
            "SELECT coalesce(max(policy_version), 0) FROM rollout_results"
        ).fetchall()
        return int(rows[0][0])

    def _load_fresh(self, task_ids: Sequence[str] | None = None) -> None:
        """Rebuild the fresh tasks (all, or those of ``task_ids``, not empty, that the caller
        has dropped): active synthesized tasks and labelled-control turns with no recorded
        results, in the order they joined."""
        id_filter, params = _ids_clause("t.id", task_ids)
        rows = self._connection.execute(
            f"""
            SELECT t.id, t.sample_key, t.environment, t.origin,
                   TRY_CAST(json_extract(t.lineage, '$.signal_version') AS INTEGER)
            FROM tasks AS t
            WHERE (t.origin = ? OR (t.origin = 'seed' AND {_LABELLED_CONTROL}))
              AND t.status = 'active'
              AND NOT EXISTS (SELECT 1 FROM rollout_results AS r WHERE r.task_id = t.id)
              {id_filter}
            ORDER BY t.created_at, t.sample_key
            """,
            [_FRESH_ORIGIN, *params],
        ).fetchall()
        for task_id, sample_key, environment, origin, version in rows:
            answers = self._answered_version(None if version is None else int(version))
            self._fresh.add(str(task_id), int(sample_key), str(environment), str(origin), answers)

    def _note_added(self, added: Sequence[tuple[Task, int]]) -> None:
        for task, sample_key in added:
            if _is_fresh(task):
                answers = self._answered_version(task.lineage.signal_version)
                self._fresh.add(task.id, sample_key, task.environment, task.origin, answers)

    def _answered_version(self, signal_version: int | None) -> int:
        """The policy version a fresh task answers: its signal's, else the newest now."""
        return self._newest_version if signal_version is None else signal_version

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
            self._note_added(tx.added)

    def _rollback(self) -> None:
        # a failed commit has already ended the transaction
        with suppress(duckdb.TransactionException):
            self._connection.rollback()

    def _query(self, sql: str, params: Sequence[object] | None = None) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._connection.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ experiences

    def _load_experiences(self) -> list[Experience]:
        if not self._connection.execute(
            "SELECT 1 FROM information_schema.tables WHERE table_name = 'experiences'"
        ).fetchall():
            return []  # a file written before experiences were kept, opened read-only
        rows = self._connection.execute("SELECT body FROM experiences ORDER BY created_at")
        return [experience_rows.from_body(body) for (body,) in rows.fetchall()]

    def add_experience(self, experience: Experience) -> bool:
        """Keep the distiller's experience once; False when it already is."""
        with self._lock:
            added, _ = self.run_once(
                experience.id,
                experience_rows.HANDLER,
                lambda tx: experience_rows.insert(tx, experience),
            )
            if added:
                self._experiences.append(experience)
        return added

    def experiences(self) -> list[Experience]:
        """Every kept experience, oldest first."""
        with self._lock:
            return list(self._experiences)

    def experience_uses(self) -> dict[str, int]:
        """How many rollout jobs carried each experience, by id."""
        if not self._experiences:
            return {}
        return dict(self._query("SELECT id, retrieved FROM experiences"))

    def note_retrieved(self, experience_ids: Sequence[str]) -> None:
        """Count one more job carrying each of ``experience_ids``."""
        if experience_ids:
            with self._transaction() as tx:
                experience_rows.note_retrieved(tx, experience_ids)

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
        tx.added.extend(zip(tasks, keys, strict=True))
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
        changed: list[str] = []
        with self._lock:
            with self._transaction() as tx:
                for chunk in _chunks(list(dict.fromkeys(task_ids)), _KEY_CHUNK):
                    rows = tx.execute(
                        f"UPDATE tasks SET status = ? WHERE status <> ? AND id IN "
                        f"({_placeholders(len(chunk))}) RETURNING id, origin, environment",
                        [status, status, *chunk],
                    )
                    for task_id, origin, environment in rows:
                        tx.counts.active[(origin, environment)] += 1 if status == "active" else -1
                        changed.append(task_id)
            self._recent.drop(changed)
            self._fresh.drop_tasks(changed)
            if status == "active" and changed:
                self._load_recent_scores(changed)
                self._load_fresh(changed)
        return len(changed)

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
        *,
        jobs: bool = False,
    ) -> list[Task]:
        """Draw ``size`` active tasks, mixing origins by ``mix`` weights.

        ``mix`` maps origin -> weight (origins left out get 0); the weights are
        renormalised over the origins that have matching active tasks. ``None`` or ``{}``
        weighs origins by their task counts: under the ``learnability`` sampler every
        matching task is then one candidate, whatever its origin. The store's
        ``sampling`` picks the tasks: ``learnability`` by how much a group on each can
        teach, with a share for tasks never rolled out; ``dynamic`` prefers tasks whose
        recent scores differ, within each origin; ``uniform`` draws every matching task
        of an origin with equal probability. Tasks are drawn without replacement; only
        when there are fewer candidates than slots are some repeated. Returns [] when no
        task matches.

        ``jobs``: the tasks become rollout jobs (the job feed). Fresh tasks (synthesized
        or labelled-control, never fed as a job, see ``FreshTasks``) then come first, newest
        signal first, in up to
        ``fresh_share`` of the slots, whatever the sampler, and are fresh no more; the
        sampler draws the rest.
        Under the learnability sampler a task then is not drawn while it holds its capped
        share of the last ``share_window`` jobs, nothing is repeated (the batch may come
        back shorter than ``size``), and the batch is counted in that window.
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
            fresh = self._fresh_picks(size, weights, environment) if jobs else []
            if fresh:
                for key in fresh:
                    available[self._fresh.origin_of(key)] -= 1
                left = any(available[origin] for origin in weights)
                weights = origin_weights(mix, available) if left else {}
            rest = size - len(fresh)
            drawn: list[int] = []
            if rest and weights:
                asked = SlotsToDraw(
                    rest, mix, weights, available, environment, rng, jobs, frozenset(fresh)
                )
                if self.sampling.learnability:
                    drawn = self._learnability_batch(asked)
                else:
                    drawn = self._mix_batch(asked)
            batch = fresh + drawn
            tasks = self._fetch_by_keys(list(dict.fromkeys(batch)))
            if jobs:  # in the order the jobs are fed: the window slides job by job
                self._shares.record(batch)
                self._fresh.drop_keys(batch)
        return [tasks[key] for key in batch]

    def _fresh_picks(
        self, size: int, weights: dict[str, float], environment: str | None
    ) -> list[int]:
        """The keys of the fresh tasks a job batch of ``size`` starts with, newest signal
        first, of the origins the weights give a share (none of an origin they leave out);
        those past ``fresh_versions`` are fresh no more."""
        if self.fresh_versions is not None:
            self._fresh.expire(self._newest_version, self.fresh_versions)
        slots = fresh_slots(self.sampling.fresh_share, size)
        return self._fresh.first(slots, environment, weights.keys())

    def fresh_tasks(self) -> list[str]:
        """Ids of the fresh tasks (synthesized or labelled-control) never fed as a job, in
        the order the next job feeds draw them before the sampler does."""
        with self._lock:
            return self._fresh.task_ids()

    def _mix_batch(self, asked: SlotsToDraw) -> list[int]:
        """The keys ``sample_batch`` draws under the dynamic and uniform samplers (the
        store's lock held): the origin mix picks each slot's origin, the sampler the task
        within it."""
        available, rng = asked.available, asked.rng
        quotas = origin_quotas(asked.weights, asked.size, rng)
        picked: dict[str, list[int]] = defaultdict(list)
        if self.sampling.dynamic:
            draws = self._dynamic_draws(
                quotas, available, asked.environment, rng, picked, asked.skip
            )
        else:
            draws = [
                self._origin_draw(
                    origin, min(quota, available[origin]), available[origin], rng, asked.skip
                )
                for origin, quota in quotas.items()
            ]
        self._run_draws(draws, asked.environment)
        for draw in draws:
            picked[draw.origin].extend(draw.picked)
        batch: list[int] = []
        for origin, quota in quotas.items():
            chosen = picked[origin]
            batch.extend(chosen)
            batch.extend(rng.choices(chosen, k=quota - len(chosen)))
        rng.shuffle(batch)
        return batch

    def _learnability_batch(self, asked: SlotsToDraw) -> list[int]:
        """The keys ``sample_batch`` draws under the learnability sampler (the store's
        lock held).

        The candidates are the tasks of the origins ``weights`` names: all of them as one
        set without a mix, one set per origin (with the mix's quotas) with one. In each
        set a slot goes to an unseen task with ``unseen_probability``, otherwise to a seen
        task drawn by weight; for jobs, tasks at their capped share are left out. The
        skipped keys are fresh, so unseen.
        """
        available, rng = asked.available, asked.rng
        environment, skip = asked.environment, asked.skip
        origins = list(asked.weights)
        seen = {origin: self._recent.of(origin, environment) for origin in origins}
        excluded = {origin: self._recent.keys(origin) for origin in origins}
        unseen = {origin: max(0, available[origin] - len(seen[origin])) for origin in origins}
        if asked.jobs:
            limit = self._shares.limit(sum(available[origin] for origin in origins))
            capped = self._shares.capped(limit) - skip
            if capped:
                self._leave_out(capped, seen, excluded, unseen, environment)
        if skip:
            excluded = {origin: keys | skip for origin, keys in excluded.items()}
        if asked.mix:
            allowed = {origin: len(seen[origin]) + unseen[origin] for origin in origins}
            if not any(allowed.values()):
                return []
            quotas = origin_quotas(origin_weights(asked.mix, allowed), asked.size, rng)
            sets = [([origin], quota) for origin, quota in quotas.items()]
        else:
            sets = [(origins, asked.size)]
        picked: list[list[int]] = []
        draws: list[list[OriginDraw]] = []
        for set_origins, slots in sets:
            candidates = [scores for origin in set_origins for scores in seen[origin]]
            task_weights = [scores.weight(self.sampling) for scores in candidates]
            unseen_in = {origin: unseen[origin] for origin in set_origins}
            probability = unseen_probability(
                sum(unseen_in.values()),
                sum(task_weights),
                self.sampling.unseen_share,
                self.sampling.unseen_weight,
            )
            to_unseen, to_seen = split_slots(
                slots, sum(unseen_in.values()), len(candidates), probability, rng
            )
            chosen = weighted_sample(candidates, task_weights, min(to_seen, len(candidates)), rng)
            picked.append([scores.sample_key for scores in chosen])
            spread = (
                {set_origins[0]: to_unseen}
                if len(set_origins) == 1
                else spread_unseen(to_unseen, unseen_in, rng)
            )
            draws.append(
                [
                    self._origin_draw(origin, need, unseen[origin], rng, excluded[origin])
                    for origin, need in spread.items()
                    if need
                ]
            )
        self._run_draws([draw for set_draws in draws for draw in set_draws], environment)
        for keys, set_draws in zip(picked, draws, strict=True):
            for draw in set_draws:
                keys.extend(draw.picked)
        batch: list[int] = []
        for keys, (_, slots) in zip(picked, sets, strict=True):
            batch.extend(keys)
            if not asked.jobs and keys:
                batch.extend(rng.choices(keys, k=slots - len(keys)))
        rng.shuffle(batch)
        return batch

    def _leave_out(
        self,
        capped: frozenset[int],
        seen: dict[str, list[TaskScores]],
        excluded: dict[str, frozenset[int]],
        unseen: dict[str, int],
        environment: str | None,
    ) -> None:
        """Take the ``capped`` tasks out of the candidates (in place): seen ones from
        ``seen``, unseen ones from the ``unseen`` counts and, like seen ones, into the
        keys their origin's key draw skips."""
        for origin in seen:
            low, high = origin_key_range(origin)
            mine = frozenset(key for key in capped if low <= key < high)
            if not mine:
                continue
            seen_keys = excluded[origin]
            seen[origin] = [s for s in seen[origin] if s.sample_key not in mine]
            unseen_capped = self._keys_matching(sorted(mine - seen_keys), environment)
            unseen[origin] = max(0, unseen[origin] - len(unseen_capped))
            excluded[origin] = seen_keys | mine

    def _origin_draw(
        self,
        origin: str,
        need: int,
        active: int,
        rng: random.Random,
        excluded: frozenset[int] = frozenset(),
    ) -> OriginDraw:
        low, _ = origin_key_range(origin)
        used = self._counts.used_keys[origin]
        return OriginDraw(origin, low, need, active=active, used=used, rng=rng, excluded=excluded)

    def _dynamic_draws(
        self,
        quotas: dict[str, int],
        available: dict[str, int],
        environment: str | None,
        rng: random.Random,
        picked: dict[str, list[int]],
        skip: frozenset[int] = frozenset(),
    ) -> list[OriginDraw]:
        """Pick each origin's tasks with results by weight (into ``picked``); return the
        key draws for its slots that go to tasks never rolled out (``skip``: unseen keys
        already in the batch, not counted in ``available``)."""
        draws: list[OriginDraw] = []
        for origin, quota in quotas.items():
            seen = self._recent.of(origin, environment)
            weights = [scores.weight(self.sampling) for scores in seen]
            unseen = max(0, available[origin] - len(seen))
            probability = unseen_probability(unseen, sum(weights), self.sampling.unseen_share)
            to_unseen, to_seen = split_slots(quota, unseen, len(seen), probability, rng)
            chosen = weighted_sample(seen, weights, min(to_seen, len(seen)), rng)
            picked[origin].extend(scores.sample_key for scores in chosen)
            if to_unseen:
                excluded = self._recent.keys(origin) | skip
                draws.append(self._origin_draw(origin, to_unseen, unseen, rng, excluded))
        return draws

    def _run_draws(self, draws: Sequence[OriginDraw], environment: str | None) -> None:
        """Run the draws against the table until each has picked its keys.

        Drawn keys are first checked on the narrow columns (status, environment); only
        the picked ones are then fetched whole: fetching a row costs one lookup per column.
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
        """Store a group's scores once; False when this message or group is already in.

        Updates the recent scores that sampling weighs by, and (except with the uniform
        sampler) retires a task once ``retire_after`` groups in a row solved it.
        """
        group_key = f"group:{results.group_id}"
        with self._lock:
            with self._transaction() as tx:
                if tx.is_processed(results.id) or tx.is_processed(group_key):
                    return False
                self._insert_results(tx, results)
                updated, retired = self._updated_scores(tx, results.samples)
                tx.mark_processed([results.id, group_key], _RESULTS_HANDLER)
            for task_id, scores in updated.items():
                self._recent.put(task_id, scores)
            self._recent.drop(retired)
            self._fresh.drop_tasks([sample.task_id for sample in results.samples])
            versions = [sample.policy_version for sample in results.samples]
            self._newest_version = max([self._newest_version, *versions])
        return True

    @staticmethod
    def _insert_results(tx: Transaction, results: RolloutResults) -> None:
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

    def _updated_scores(
        self, tx: Transaction, samples: Sequence[ScoreSample]
    ) -> tuple[dict[str, TaskScores], list[str]]:
        """The recent scores of the group's tasks once it commits, and the tasks it retires
        (retired inside ``tx``). Results of tasks not active in the pool change nothing."""
        by_task: dict[str, list[float]] = defaultdict(list)
        for sample in samples:
            by_task[sample.task_id].append(sample.score)
        updated: dict[str, TaskScores] = {}
        retired: list[str] = []
        retire_after = self.sampling.retire_after if self.sampling.retires else 0
        for task_id, scores in by_task.items():
            previous = self._recent.get(task_id) or self._no_scores_yet(tx, task_id)
            if previous is None:
                continue
            current = previous.with_group(scores, self.sampling.window)
            if retire_after and current.solved_streak >= retire_after:
                tx.execute("UPDATE tasks SET status = 'retired' WHERE id = ?", [task_id])
                tx.counts.active[(current.origin, current.environment)] -= 1
                retired.append(task_id)
            else:
                updated[task_id] = current
        return updated, retired

    @staticmethod
    def _no_scores_yet(tx: Transaction, task_id: str) -> TaskScores | None:
        # the status is checked here, not in SQL: a second predicate costs the index lookup
        rows = tx.execute(
            "SELECT origin, environment, sample_key, status FROM tasks WHERE id = ?", [task_id]
        )
        if not rows or rows[0][3] != "active":
            return None
        origin, environment, sample_key, _ = rows[0]
        return TaskScores(
            origin=origin, environment=environment, sample_key=int(sample_key), recent=()
        )

    def recent_scores(self, task_id: str) -> TaskScores | None:
        """What sampling knows of an active task; None before its first result."""
        with self._lock:
            return self._recent.get(task_id)

    def recent_jobs(self, task_id: str) -> int:
        """How many of the last ``share_window - 1`` jobs fed (``sample_batch(...,
        jobs=True)``) were of this task: what the learnability sampler's cap counts."""
        rows = self._query("SELECT sample_key FROM tasks WHERE id = ?", [task_id])
        if not rows:
            return 0
        with self._lock:
            return self._shares.count(int(rows[0][0]))

    def failed_tasks(self, limit: int) -> list[Task]:
        """Active tasks whose latest recorded group has a failure (a score below 1), the
        most recent first, at most ``limit``: the tasks the target fails."""
        rows = self._query(
            "SELECT task_id FROM (SELECT task_id, max(recorded_at) AS latest_at, "
            "min(score) AS worst FROM rollout_results GROUP BY task_id, group_id "
            "QUALIFY row_number() OVER (PARTITION BY task_id ORDER BY latest_at DESC) = 1) "
            "AS latest JOIN tasks ON tasks.id = latest.task_id "
            "WHERE worst < 1.0 AND tasks.status = 'active' ORDER BY latest_at DESC LIMIT ?",
            [limit],
        )
        tasks = (self.get_task(str(task_id)) for (task_id,) in rows)
        return [task for task in tasks if task is not None]

    def uniform_group_share(self, since: float | None = None) -> UniformGroupShare:
        """Recorded groups (recorded at or after ``since``, Unix seconds) whose scores are
        all equal: those the learner drops as uniform, measured from the file alone."""
        condition = "WHERE recorded_at >= ?" if since is not None else ""
        rows = self._query(
            "SELECT count(*), count(*) FILTER (WHERE lowest = highest) FROM ("
            "SELECT min(score) AS lowest, max(score) AS highest FROM rollout_results "
            f"{condition} GROUP BY group_id)",
            [since] if since is not None else None,
        )
        groups, uniform = rows[0]
        return UniformGroupShare(groups=int(groups), uniform=int(uniform))

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

    def seeded_labelled_tasks(self) -> int:
        """Labelled tasks the pool was seeded with (origin "seed"), leaving out the
        labelled-control turns an experiment added during the run."""
        ((count,),) = self._query(
            f"SELECT count(*) FROM tasks AS t WHERE t.origin = 'seed' AND NOT {_LABELLED_CONTROL}"
        )
        return int(count)

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
            "signal": _stage(
                chain.signal_id,
                kind=chain.signal_kind,
                evidence=chain.signal_evidence,
                parent_task_id=chain.parent_task_id,
            ),
            "context": None if chain.context is None else _context_dict(chain.context),
            "exploration": _stage(
                chain.exploration_id, mode=chain.exploration_mode, steps=chain.exploration_steps
            ),
            "candidate": _stage(chain.candidate_id),
            "verdict": verdict,
        }


def _is_fresh(task: Task) -> bool:
    """A synthesized task (a child of a signal, or the same machinery's unguided child) or
    a labelled turn the labelled_control arm added, active: fresh until first fed as a job."""
    new_to_run = task.origin == _FRESH_ORIGIN or (
        task.origin == "seed" and task.lineage.labelled_control
    )
    return new_to_run and task.status == "active"


def _stage(stage_id: str | None, **details: Any) -> dict[str, Any] | None:
    """A stage of a lineage chain: its id and details, or None where the task had none."""
    return None if stage_id is None else {"id": stage_id, **details}


def _context_dict(context: ExplorationContext) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.to_builtins(context)
    return result
