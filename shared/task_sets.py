"""D0: the task set a run with no labels starts from, as one file.

``coevolve discover`` builds it by unguided exploration of an environment's initial
states, abstracted and judged as synthesized tasks are, and writes it here; pool-store
seeds the pool from it when the run's ``labels`` is ``none``. The file records what made
it (environment, API classes, role model, code version, the build's counts and minutes)
and the sha256 of its tasks, so a run or an experiment can say which D0 it started from
and a damaged or edited file is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import msgspec

from coevolve.shared.messages import Task

log = logging.getLogger(__name__)

D0_FORMAT = "coevolve-d0/1"


class D0Build(msgspec.Struct, kw_only=True):
    """How the set was built: minutes, explorations (by outcome), candidates, verdicts."""

    minutes: float
    explorations: int
    explorations_by_outcome: dict[str, int] = msgspec.field(default_factory=dict)
    candidates: int = 0
    dropped_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    verdicts_by_outcome: dict[str, int] = msgspec.field(default_factory=dict)
    start_states: int = 0
    ended_by: str = ""  # tasks | max_explorations | max_minutes | interrupted
    # built by `up` as the first tasks of a D0 of this many: discovery beside training goes
    # on until the pool holds that many discovered tasks. 0: a whole D0, nothing beside
    first_tasks_of: int = 0


class D0File(msgspec.Struct, kw_only=True):
    format: str = D0_FORMAT
    environment: str
    classes: list[str] | None
    role_model: str
    code_version: str | None
    created_at: str
    build: D0Build
    sha256: str
    tasks: list[Task]
    # discovered tasks kept out of training, the evaluator's held-out set (d0.heldout_every)
    heldout: list[Task] = msgspec.field(default_factory=list)

    @property
    def explorations_per_task(self) -> float | None:
        return self.build.explorations / len(self.tasks) if self.tasks else None


class D0Error(ValueError):
    """A D0 file that is missing, damaged, edited or not a D0 file."""


def tasks_digest(tasks: list[Task], heldout: list[Task] | None = None) -> str:
    """sha256 of the tasks as the file stores them (and of the held-out ones, if any)."""
    digest = hashlib.sha256(msgspec.json.encode(tasks))
    if heldout:
        digest.update(msgspec.json.encode(heldout))
    return digest.hexdigest()


def split_heldout(accepted: list[Task], every: int) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks): the 1st, (every+1)th, ... accepted task is held
    out, so the first one is (a held-out figure from the start); every 0: none."""
    if every <= 0:
        return list(accepted), []
    heldout = accepted[::every]
    return [t for i, t in enumerate(accepted) if i % every], heldout


def load_heldout_file(path: Path) -> list[Task]:
    """A user's held-out tasks: a JSON list of tasks, or an object whose ``tasks`` is one
    (a D0 file too); ValueError when unreadable or a task has no request or calls."""
    try:
        raw = msgspec.json.decode(path.read_bytes())
        listed = raw.get("tasks") if isinstance(raw, dict) else raw
        tasks = msgspec.convert(listed, list[Task])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"held-out file {path}: {exc}") from exc
    unusable = [t.id for t in tasks if not t.user_turns or not any(t.ground_truth)]
    if unusable or not tasks:
        raise ValueError(f"held-out file {path}: no tasks, or tasks without a request or calls")
    return tasks


def write_d0(path: Path, d0: D0File) -> None:
    """Write ``d0`` (sha256 filled in) atomically: a reader never sees half a file."""
    d0.sha256 = tasks_digest(d0.tasks, d0.heldout)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = msgspec.json.format(msgspec.json.encode(d0), indent=1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_d0(path: Path, sha256: str | None = None) -> D0File:
    """The D0 file at ``path``; D0Error when missing, unreadable, not D0, edited since it
    was written, not ``sha256`` (when given), or holding a task nobody could train on."""
    if not path.is_file():
        raise D0Error(f"no D0 file at {path}: build one with `coevolve discover --out {path}`")
    try:
        d0 = msgspec.json.decode(path.read_bytes(), type=D0File)
    except msgspec.DecodeError as exc:
        raise D0Error(f"{path} is not a D0 file: {exc}") from exc
    if d0.format != D0_FORMAT:
        raise D0Error(f"{path}: format {d0.format!r}, expected {D0_FORMAT!r}")
    digest = tasks_digest(d0.tasks, d0.heldout)
    if digest != d0.sha256:
        raise D0Error(
            f"{path}: its tasks have sha256 {digest[:12]}, the file says {d0.sha256[:12]}"
        )
    if sha256 is not None and digest != sha256:
        raise D0Error(f"{path}: sha256 {digest[:12]}, expected {sha256[:12]}")
    unusable = [t.id for t in d0.tasks + d0.heldout if not t.user_turns or not any(t.ground_truth)]
    if unusable:
        raise D0Error(f"{path}: tasks without a request or calls: {unusable[:5]}")
    if not d0.tasks:
        raise D0Error(f"{path}: no tasks")
    return d0


# ------------------------------------------------------- a build in progress


class ExplorationRecord(msgspec.Struct, kw_only=True):
    """One finished exploration of the build (a line of the partial file)."""

    index: int
    start_id: str
    outcome: str
    candidates: int = 0
    dropped: list[str] = msgspec.field(default_factory=list)
    dropped_details: list[str] = msgspec.field(default_factory=list)  # clipped, per drop
    verdicts: list[str] = msgspec.field(default_factory=list)
    accepted: list[Task] = msgspec.field(default_factory=list)
    seconds: float = 0.0


def read_partial(path: Path) -> list[ExplorationRecord]:
    """The explorations an earlier, interrupted build finished (a torn last line is
    dropped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        try:
            records.append(msgspec.json.decode(line, type=ExplorationRecord))
        except msgspec.DecodeError:
            log.warning("%s: dropped an unreadable line", path)
    return records


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial.jsonl")
