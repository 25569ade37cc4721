"""Rate limiting, de-duplication and persistence of the signal monitor's state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from coevolve.services.signal_monitor.config import MonitorConfig
from coevolve.services.signal_monitor.handler import SignalMonitor
from coevolve.services.signal_monitor.state import MonitorState, StateStore
from tests.services.signal_monitor.signal_groups import OTHER_TASK, TASK, group

BOUNDARY_ONLY = MonitorConfig(kinds=("boundary",), cooldown_s=60.0, bucket_capacity=2.0)


def test_cooldown_per_task_and_kind() -> None:
    monitor = SignalMonitor(BOUNDARY_ONLY)
    assert len(monitor.process(group([1.0, 0.0]), TASK, now=0.0)) == 1
    assert monitor.process(group([1.0, 0.0]), TASK, now=59.9) == []  # inside the cooldown
    other = group([1.0, 0.0], task_id=OTHER_TASK.id)
    assert len(monitor.process(other, OTHER_TASK, now=59.9)) == 1  # other tasks unaffected
    assert len(monitor.process(group([1.0, 0.0]), TASK, now=60.0)) == 1  # cooldown over
    assert monitor.state.suppressed == {"cooldown": 1}


def test_task_budget_stops_one_task_flooding() -> None:
    """Past the cooldown, a task still gets at most ``bucket_capacity`` signals in a burst
    and then one per 1/refill seconds, however many groups keep failing."""
    config = MonitorConfig(
        kinds=("boundary",), cooldown_s=0.0, bucket_capacity=2.0, bucket_refill_per_s=0.01
    )
    monitor = SignalMonitor(config)
    emitted = [len(monitor.process(group([1.0, 0.0]), TASK, now=float(t))) for t in range(50)]
    assert sum(emitted) == 2  # burst of 2, refill 0.49 tokens in 49 s: nothing more
    assert monitor.state.suppressed["task_budget"] == 48
    assert len(monitor.process(group([1.0, 0.0]), TASK, now=150.0)) == 1  # refilled
    other = group([1.0, 0.0], task_id=OTHER_TASK.id)
    assert len(monitor.process(other, OTHER_TASK, now=10.0)) == 1


def test_redelivered_group_changes_nothing() -> None:
    monitor = SignalMonitor(MonitorConfig(kinds=("boundary", "forgetting")))
    recorded = group([1.0, 0.0])
    assert [s.kind for s in monitor.process(recorded, TASK, now=0.0)] == ["boundary"]
    snapshot = json.dumps(msgspec.to_builtins(monitor.state))
    assert monitor.process(recorded, TASK, now=1.0) == []
    assert json.dumps(msgspec.to_builtins(monitor.state)) == snapshot


def test_signal_ids_are_stable_for_a_group() -> None:
    """Reprocessing a group from a state saved before it yields the same signal ids, so the
    bus drops the duplicates published after a crash."""
    recorded = group([1.0, 0.0])
    first = SignalMonitor(BOUNDARY_ONLY).process(recorded, TASK, now=0.0)
    again = SignalMonitor(BOUNDARY_ONLY).process(recorded, TASK, now=3.0)
    assert [s.id for s in first] == [s.id for s in again]


def test_restart_keeps_windows_counts_entropies_and_cooldowns(tmp_path: Path) -> None:
    config = MonitorConfig(
        rare_min_actions=20, uncertainty_min_samples=8, cooldown_s=100.0, bucket_capacity=10
    )
    store = StateStore(tmp_path / "signal_monitor" / "state.json")
    monitor = SignalMonitor(config, store.load())
    # Task A is solved; B gets a boundary signal; 20 common calls; 8 calm entropies.
    solved = group([1.0] * 4, calls=[["ls", "cd", "ls"]] * 4, entropies=[[0.2]] * 4)
    assert monitor.process(solved, TASK, now=0.0) == []
    mixed = group(
        [1.0, 0.0, 1.0, 0.0],
        calls=[["ls", "cd"]] * 4,
        entropies=[[0.2]] * 4,
        task_id=OTHER_TASK.id,
    )
    assert [s.kind for s in monitor.process(mixed, OTHER_TASK, now=0.0)] == ["boundary"]
    store.save(monitor.state)
    saved = monitor.state

    restarted = SignalMonitor(config, StateStore(store.path).load())
    assert restarted.state == saved
    # Forgetting needs the pre-restart success; rare needs the counts; uncertainty needs
    # the entropy sample; all three fire on the first group after the restart.
    failing = group([0.0] * 2, calls=[["ls"], ["rename"]], entropies=[[0.2], [3.0]])
    kinds = sorted(s.kind for s in restarted.process(failing, TASK, now=10.0))
    assert kinds == ["forgetting", "rare", "uncertainty"]
    # The cooldown for B's boundary signal survived the restart too.
    again = group([1.0, 0.0], task_id=OTHER_TASK.id)
    assert restarted.process(again, OTHER_TASK, now=50.0) == []
    assert restarted.state.suppressed == {"cooldown": 1}
    # And the groups seen before the restart are still recognised.
    assert restarted.seen(mixed.id)


def test_save_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    store.save(MonitorState(unigram_total=1))
    store.save(MonitorState(unigram_total=2))
    assert sorted(os.listdir(tmp_path)) == ["state.json"]
    assert store.load().unigram_total == 2


def test_corrupt_state_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"score_windows": {"t": [1.0')
    state = StateStore(path).load()
    assert state == MonitorState()
    assert not path.exists()
    assert len(list(tmp_path.glob("state.json.corrupt-*"))) == 1
