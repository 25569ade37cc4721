"""The experiences table: the distiller's advice, kept with its lineage (the group and the
two trajectories it compares, in ``body``) and how often rollout jobs carried it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from coevolve.shared.messages import Experience

HANDLER = "experience"


class Executes(Protocol):
    def execute(
        self, sql: str, params: Sequence[object] | None = None
    ) -> list[tuple[Any, ...]]: ...


def insert(tx: Executes, experience: Experience) -> None:
    tx.execute(
        "INSERT INTO experiences VALUES (?, ?, ?, ?, ?, 0, ?)",
        [
            experience.id,
            experience.task_id,
            experience.environment,
            experience.text,
            msgspec.json.encode(experience).decode(),
            experience.created_at,
        ],
    )


def from_body(body: str) -> Experience:
    return msgspec.json.decode(body, type=Experience)


def note_retrieved(tx: Executes, ids: Sequence[str]) -> None:
    for experience_id in ids:
        tx.execute("UPDATE experiences SET retrieved = retrieved + 1 WHERE id = ?", [experience_id])
