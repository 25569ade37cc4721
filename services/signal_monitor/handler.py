"""The signal monitor's work without the bus: a rollout group and its task in, signals
out, judged against what the monitor remembers (``state.py``) by the detectors
(``detectors.py``)."""

from __future__ import annotations

import time
from collections import OrderedDict

import msgspec

from coevolve.services.signal_monitor.config import MonitorConfig
from coevolve.services.signal_monitor.detectors import Finding, detect, group_score
from coevolve.services.signal_monitor.state import MonitorState, admit_signal, remember_group
from coevolve.shared.messages import RolloutGroup, Signal, Task, derived_id


class SignalMonitor:
    """Turns rollout groups into rate-limited signals, keeping ``state`` up to date.

    The caller persists ``state`` (see :class:`~.state.StateStore`) after publishing the
    returned signals and before acknowledging the group.
    """

    def __init__(self, config: MonitorConfig | None = None, state: MonitorState | None = None):
        self.config = config or MonitorConfig()
        self.state = state or MonitorState()
        self._recent = set(self.state.recent_groups)

    def seen(self, group_id: str) -> bool:
        return group_id in self._recent

    def process(self, group: RolloutGroup, task: Task, now: float | None = None) -> list[Signal]:
        """The signals for ``group`` of ``task``; [] for a group processed before."""
        if group.task_id != task.id:
            raise ValueError(f"group {group.id} is for task {group.task_id}, not {task.id}")
        if self.seen(group.id):
            return []
        now = time.time() if now is None else now
        config = self.config
        signals: list[Signal] = []
        for finding in detect(group, self.state, config):
            reason = admit_signal(
                self.state,
                task.id,
                finding.kind,
                now,
                cooldown_s=config.cooldown_s,
                bucket_capacity=config.bucket_capacity,
                bucket_refill_per_s=config.bucket_refill_per_s,
            )
            if reason is None:
                signals.append(self._signal(finding, group, task, now))
        remember_group(self.state, group.id, config.remember_groups)
        self._recent.add(group.id)
        if len(self._recent) > len(self.state.recent_groups):
            self._recent = set(self.state.recent_groups)
        return signals

    def _signal(self, finding: Finding, group: RolloutGroup, task: Task, now: float) -> Signal:
        trajectory = finding.trajectory
        if self.config.strip_tokens:
            trajectory = msgspec.structs.replace(
                trajectory, token_ids=[], logprobs=[], loss_mask=[]
            )
        return Signal(
            id=derived_id("signal", group.id, finding.kind),
            kind=finding.kind,
            task=task,
            trajectory=trajectory,
            group_id=group.id,
            policy_version=group.policy_version,
            evidence={
                **finding.evidence,
                "group_reward_mean": group_score(group),
                "trajectory_reward": finding.trajectory.reward,
            },
            created_at=now,
        )


class TaskCache:
    """The most recently used tasks by id (tasks never change once in the pool)."""

    def __init__(self, capacity: int) -> None:
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        self._capacity = max(1, capacity)

    def get(self, task_id: str) -> Task | None:
        task = self._tasks.get(task_id)
        if task is not None:
            self._tasks.move_to_end(task_id)
        return task

    def put(self, task: Task) -> None:
        self._tasks[task.id] = task
        self._tasks.move_to_end(task.id)
        while len(self._tasks) > self._capacity:
            self._tasks.popitem(last=False)
