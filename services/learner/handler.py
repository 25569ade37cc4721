"""The learner's work without the bus: one GRPO step on gathered groups, the checkpoint
that records it, and which version number new weights are announced under.

The GRPO update itself is ``trainer.GrpoLearner``; the warm start is ``warm_start.py``.

Each step also appends one JSON line to ``RUN_DIR/learner/steps.jsonl`` (``record_step``):
which groups it trained on (task, origin) and which it dropped as stale, for
``coevolve report``'s draws and repair tables.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from coevolve.services.learner.grpo import filter_stale, group_version
from coevolve.services.learner.preference_pairs import PairSide
from coevolve.services.learner.ranks import Ranks
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.messages import PolicyVersion, RolloutGroup, Task

# one JSON line per GRPO step, under the run directory (see ``step_record``)
STEPS_FILE = "learner/steps.jsonl"
# one line per wait of the learner for the data loop (the pacing contract)
PACING_FILE = "learner/pacing.jsonl"


def train_step(
    learner: GrpoLearner,
    groups: list[RolloutGroup],
    ranks: Ranks | None,
    experts: Mapping[str, PairSide] | None = None,
) -> StepMetrics:
    """One step on ``groups`` (``experts``: the expert sides of a preference objective):
    in this process, or shared among the data-parallel ranks."""
    if ranks is None:
        return learner.step(groups, experts)
    return ranks.step(learner, groups, experts)


def step_record(
    groups: Sequence[RolloutGroup],
    *,
    step: int,
    version: int,
    published: bool,
    version_before: int,
    max_staleness: int,
    at: float | None = None,
) -> dict[str, Any]:
    """What one step trained on, as the line ``record_step`` appends.

    ``step`` and ``version`` are the learner's after the step; ``published`` says whether
    it updated the weights (and so published ``version``). ``groups`` are those the step
    was given: the ones within ``max_staleness`` of ``version_before`` (the learner's
    version when the step began, as the trainer's own ``filter_stale`` decides) go under
    ``groups``, each with its task, origin, policy version, mean reward and whether its
    rewards were all equal (``uniform``: no outcome advantage); the others under ``stale``.
    A group the attributor worked on (``rollout.step_credit``) also has ``label_s``, its
    seconds on the group, ``labelled``, its trajectories that carry step labels, and
    ``good`` / ``bad``, its steps labelled each way; a group with navigated trajectories
    (``rollout.navigation``) has ``navigated``, how many. A group the failure agent
    rolled has ``agent`` ("failure") and ``rewards``, its trajectories' rewards.
    """
    kept, _ = filter_stale(groups, version_before, max_staleness)
    kept_ids = {id(group) for group in kept}

    def entry(group: RolloutGroup) -> dict[str, Any]:
        rewards = group.rewards()
        fields = {
            "group_id": group.id,
            "task_id": group.task_id,
            "origin": group.origin,
            "policy_version": group_version(group),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "uniform": not rewards or max(rewards) == min(rewards),
        }
        if group.agent != "target":
            # the failure agent's: its rewards, to set its failures against the target's
            fields |= {"agent": group.agent, "rewards": rewards}
        labelled = sum(bool(t.step_labels) for t in group.trajectories)
        if group.label_s or labelled:
            labels = [label for t in group.trajectories for label in t.step_labels]
            fields |= {
                "label_s": group.label_s,
                "labelled": labelled,
                "good": labels.count(1),
                "bad": labels.count(-1),
            }
        navigated = sum(bool(t.experience_ids) for t in group.trajectories)
        if navigated:
            fields["navigated"] = navigated
        return fields

    return {
        "step": step,
        "version": version,
        "published": published,
        "time": time.time() if at is None else at,
        "groups": [entry(g) for g in groups if id(g) in kept_ids],
        "stale": [entry(g) for g in groups if id(g) not in kept_ids],
    }


def record_wait(
    path: Path, *, step: int, waited_s: float, delivered: int, owed: int, ran_out: bool
) -> None:
    """Append one wait of the learner for the data loop (``PACING_FILE``); ``ran_out``: it
    lasted ``pacing.max_wait_s`` with the loop still behind."""
    record = {
        "step": step,
        "waited_s": round(waited_s, 1),
        "delivered": delivered,
        "owed": owed,
        "ran_out": ran_out,
        "at": time.time(),
    }
    append_step_record(path, record)


def append_step_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line, flushed to disk. A line cut short by a crash
    is closed first, so the next record starts on a line of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    with path.open("ab") as handle:
        if handle.tell() > 0:
            with path.open("rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    line = b"\n" + line
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def record_step(
    path: Path,
    groups: Sequence[RolloutGroup],
    metrics: StepMetrics,
    *,
    version_before: int,
    max_staleness: int,
) -> dict[str, Any]:
    """Append the record of the step that ``metrics`` describes (see ``step_record``)."""
    record = step_record(
        groups,
        step=metrics.step,
        version=metrics.version,
        published=metrics.trained,
        version_before=version_before,
        max_staleness=max_staleness,
    )
    append_step_record(path, record)
    return record


def trained_ids_file(checkpoint: Path) -> Path:
    return checkpoint.with_suffix(".groups.json")


def save_checkpoint(learner: GrpoLearner, checkpoint: Path, trained: Iterable[str]) -> None:
    """The checkpoint, then the ids of the groups it includes (both atomic renames)."""
    learner.save_checkpoint(checkpoint)
    write_atomically(trained_ids_file(checkpoint), json.dumps(list(trained)).encode())


def trained_ids(checkpoint: Path) -> list[str]:
    """The ids of the groups the checkpoint includes ([] before the first)."""
    file = trained_ids_file(checkpoint)
    return list(json.loads(file.read_text())) if file.exists() else []


def version_to_announce(
    version: int, announced: PolicyVersion | None, digest: Callable[[], str]
) -> int | None:
    """The number to announce the learner's weights under (None: nothing to announce).

    ``announced`` is the bus's latest announcement and ``digest()`` the sha256 of the
    learner's weights. A restored checkpoint whose number the bus knows with other weights
    moves past it: no version number is announced twice."""
    if version == 0:
        return 0 if announced is None else None  # no warm start: rollout starts from v0
    if announced is None or announced.version < version:
        return version
    if announced.version == version and announced.sha256 == digest():
        return None  # this very checkpoint was announced before a restart
    return announced.version + 1


def saved_tasks(path: Path) -> list[Task] | None:
    """Tasks kept by ``keep_tasks`` (None: none kept)."""
    return msgspec.json.decode(path.read_bytes(), type=list[Task]) if path.exists() else None


def keep_tasks(path: Path, tasks: list[Task]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, msgspec.json.encode(tasks))


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# the learner's phase while its steps find no gradient: `status` and `up` show why
NO_GRADIENT_PHASE = "no gradient"


def no_gradient_reason(groups: Sequence[RolloutGroup]) -> str | None:
    """Why a step on ``groups`` had nothing to learn from, when every group's episodes
    scored alike (None when one did not)."""
    rewards = [group.rewards() for group in groups]
    if not rewards or any(r and max(r) != min(r) for r in rewards):
        return None
    scores = {round(r[0], 3) for r in rewards if r}
    if scores == {0.0}:
        return (
            f"every episode of {len(groups)} groups scored 0: their tasks are beyond this "
            "policy for now (rollout.partial_credit rewards matched calls; easier tasks or "
            "a longer warm start help)"
        )
    if scores == {1.0}:
        return f"every episode of {len(groups)} groups was solved: nothing left to learn there"
    shown = ", ".join(f"{s:g}" for s in sorted(scores))
    return f"in each of {len(groups)} groups every episode scored the same ({shown})"
