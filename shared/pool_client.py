"""Request/reply client of pool-store, for any service or the CLI."""

from __future__ import annotations

from typing import TypeVar

from coevolve.shared.messages import (
    AddTasks,
    AddTasksReply,
    AtomsFor,
    ErrorReply,
    ExperiencesReply,
    GetStats,
    GetTask,
    GetTaskReply,
    LineageQuery,
    LineageReply,
    ListExperiences,
    Message,
    PoolReply,
    PoolStats,
    SampleBatch,
    SampleBatchReply,
    Task,
    TasksCalling,
    decode,
    encode,
)
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import POOL_ADD, POOL_RPC
from coevolve.shared.runtime.telemetry import inject

R = TypeVar("R", bound=Message)


class PoolError(RuntimeError):
    """pool-store answered with an error."""


class PoolClient:
    def __init__(self, bus: Bus, timeout_s: float | None = None) -> None:
        self.bus = bus
        self.timeout_s = timeout_s or bus.settings.request_timeout_s

    async def _call(self, request: Message, expected: type[R], subject: str = POOL_RPC) -> R:
        reply = await self.bus.nc.request(
            subject, encode(request), timeout=self.timeout_s, headers=inject({})
        )
        answer: Message = decode(reply.data, PoolReply)  # type: ignore[arg-type]
        if isinstance(answer, ErrorReply):
            raise PoolError(answer.error)
        if not isinstance(answer, expected):
            raise PoolError(f"expected {expected.__name__}, got {type(answer).__name__}")
        return answer

    async def add_tasks(self, tasks: list[Task]) -> AddTasksReply:
        """Add tasks by hand (operator or admin credentials)."""
        return await self._call(AddTasks(tasks=tasks), AddTasksReply, POOL_ADD)

    async def get(self, task_id: str) -> Task | None:
        return (await self._call(GetTask(task_id=task_id), GetTaskReply)).task

    async def sample(
        self, size: int, mix: dict[str, float] | None = None, seed: int | None = None
    ) -> list[Task]:
        request = SampleBatch(size=size, mix=mix or {}, seed=seed)
        return (await self._call(request, SampleBatchReply)).tasks

    async def atoms_for(self, task_id: str, limit: int = 20) -> list[Task]:
        """Tasks that may be joined with ``task_id`` into one composed turn (``AtomsFor``)."""
        request = AtomsFor(task_id=task_id, limit=limit)
        return (await self._call(request, SampleBatchReply)).tasks

    async def tasks_calling(
        self, functions: list[str], environment: str, exclude: list[str], limit: int = 20
    ) -> list[Task]:
        """Unsynthesized tasks that call one of ``functions`` (``TasksCalling``)."""
        request = TasksCalling(
            functions=functions, environment=environment, exclude=exclude, limit=limit
        )
        return (await self._call(request, SampleBatchReply)).tasks

    async def stats(self) -> PoolStats:
        return await self._call(GetStats(), PoolStats)

    async def lineage(self, task_id: str) -> LineageReply:
        return await self._call(LineageQuery(task_id=task_id), LineageReply)

    async def experiences(self, limit: int = 50) -> ExperiencesReply:
        return await self._call(ListExperiences(limit=limit), ExperiencesReply)
