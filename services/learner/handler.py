"""The learner's work without the bus: one GRPO step on gathered groups, the checkpoint
that records it, and which version number new weights are announced under.

The GRPO update itself is ``trainer.GrpoLearner``; the warm start is ``warm_start.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from coevolve.services.learner.ranks import Ranks
from coevolve.services.learner.trainer import GrpoLearner, StepMetrics
from coevolve.shared.messages import PolicyVersion, RolloutGroup, Task


def train_step(
    learner: GrpoLearner, groups: list[RolloutGroup], ranks: Ranks | None
) -> StepMetrics:
    """One step on ``groups``: in this process, or shared among the data-parallel ranks."""
    if ranks is None:
        return learner.step(groups)
    return ranks.step(learner, groups)


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
