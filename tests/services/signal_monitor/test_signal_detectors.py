"""Each signal kind on recorded groups, firing and not firing at the edges of its threshold."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from coevolve.services.signal_monitor.config import MonitorConfig
from coevolve.services.signal_monitor.detectors import (
    detect,
    detect_boundary,
    detect_forgetting,
    detect_rare,
    detect_uncertainty,
    trajectory_actions,
)
from coevolve.services.signal_monitor.handler import SignalMonitor
from coevolve.services.signal_monitor.state import MonitorState, count_patterns, quantile
from coevolve.shared.envs.bfcl.environment import BfclEnvironment
from coevolve.shared.envs.bfcl.tasks import load_turn_tasks
from coevolve.shared.messages import RolloutGroup, Signal, decode, encode
from tests.services.signal_monitor.signal_groups import TASK, group, trajectory
from tests.support.messages import untokenized_trajectory

CONFIG = MonitorConfig()


# --------------------------------------------------------------------------- forgetting


@pytest.mark.parametrize(
    ("previous", "current_rewards", "fires"),
    [
        ([1.0, 0.0], [0.0, 0.0], True),  # solved before, failing now
        ([0.5], [0.25, 0.25], True),  # exactly 0.5 before counts as "was solving"
        ([0.49], [0.0, 0.0], False),  # just below 0.5 before: never solved
        ([1.0], [0.5, 0.5], False),  # current exactly 0.5 is not a failure
        ([1.0], [0.5, 0.49], True),  # current mean 0.495 just below 0.5
        ([], [0.0], False),  # no history
    ],
)
def test_forgetting_threshold_edges(
    previous: list[float], current_rewards: list[float], fires: bool
) -> None:
    finding = detect_forgetting(group(current_rewards), previous, CONFIG)
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.kind == "forgetting"
        assert finding.evidence["current_score"] == pytest.approx(np.mean(current_rewards))
        assert finding.evidence["best_in_window"] == max(previous)
        assert finding.trajectory.reward == min(current_rewards)


def test_forgetting_window_edge() -> None:
    """A success W-1 groups back is still in the window of W; W groups back it is not."""
    in_window = [1.0] + [0.0] * (CONFIG.window - 2)
    out_of_window = [1.0] + [0.0] * (CONFIG.window - 1)
    fired = detect_forgetting(group([0.0]), in_window, CONFIG)
    assert fired is not None
    assert len(fired.evidence["window"]) == CONFIG.window
    assert detect_forgetting(group([0.0]), out_of_window, CONFIG) is None


def test_forgetting_through_the_monitor_state() -> None:
    """The window lives in the state: success then failure on the same task fires once."""
    monitor = SignalMonitor(MonitorConfig(kinds=("forgetting",)))
    assert monitor.process(group([1.0, 1.0]), TASK, now=0.0) == []
    assert monitor.process(group([0.0, 0.0]), TASK, now=1000.0)[0].kind == "forgetting"
    assert monitor.state.score_windows[TASK.id] == [1.0, 0.0]


# --------------------------------------------------------------------------- boundary


@pytest.mark.parametrize(
    ("rewards", "fires"),
    [
        ([1.0, 0.0], True),
        ([0.51, 0.49], True),  # just above and just below
        ([0.5, 0.0], False),  # exactly 0.5 is not "above"
        ([1.0, 0.5], False),  # exactly 0.5 is not "below"
        ([0.5, 0.5, 0.5], False),
        ([1.0, 1.0, 1.0], False),
        ([0.0, 0.0], False),
        ([1.0], False),
    ],
)
def test_boundary_threshold_edges(rewards: list[float], fires: bool) -> None:
    finding = detect_boundary(group(rewards), MonitorConfig(boundary_margin=None))
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.trajectory.reward < 0.5
        assert finding.evidence["rewards"] == rewards


@pytest.mark.parametrize(
    ("rewards", "fires"),
    [
        ([0.1, 0.0, 0.0], True),  # one attempt matched a call of four, none solved it
        ([0.4 * 0.25, 0.0], True),  # the float product partial credit writes
        ([0.3, 0.2], True),
        ([0.05, 0.0], False),  # under the margin
        ([0.2, 0.2, 0.2], False),  # a uniform group: nothing separates the attempts
        ([1.0, 1.0], False),
        ([1.0, 0.9], False),  # all above the threshold: no failure to aim at
        ([0.5, 0.0], True),  # the threshold rule's edge, which the margin covers
    ],
)
def test_boundary_margin_flags_groups_of_partial_credit(rewards: list[float], fires: bool) -> None:
    finding = detect_boundary(group(rewards), MonitorConfig(boundary_margin=0.1))
    assert (finding is not None) is fires
    if finding is not None:
        assert finding.trajectory.reward == min(rewards)
        assert finding.evidence["spread"] == pytest.approx(max(rewards) - min(rewards))


def test_boundary_margin_contrast_is_the_best_attempt() -> None:
    recorded = group([0.0, 0.2, 0.1], calls=[["ls"], ["cd", "mv"], ["rm"]])
    finding = detect_boundary(recorded, CONFIG)
    assert finding is not None
    assert finding.evidence["successes"] == 0 and finding.evidence["failures"] == 3
    assert finding.evidence["success_actions"] == ["cd", "mv"]
    assert trajectory_actions(finding.trajectory) == ["ls"]


def test_boundary_evidence_points_at_a_success() -> None:
    recorded = group([0.0, 1.0, 0.0], calls=[["ls"], ["cd", "mv"], ["rm"]])
    finding = detect_boundary(recorded, CONFIG)
    assert finding is not None
    assert finding.evidence["success_actions"] == ["cd", "mv"]
    assert finding.evidence["successes"] == 1 and finding.evidence["failures"] == 2


# --------------------------------------------------------------------------- rare


def _state_with(counts: dict[str, int]) -> MonitorState:
    state = MonitorState()
    for name, count in counts.items():
        count_patterns(state, [[name]] * count)
    return state


def _rare_after(history: dict[str, int], calls: list[list[str]], config: MonitorConfig):  # type: ignore[no-untyped-def]
    state = _state_with(history)
    recorded = group([0.0] * len(calls), calls=calls)
    count_patterns(state, (trajectory_actions(t) for t in recorded.trajectories))
    return detect_rare(recorded, state, config), state


def test_rare_exactly_theta_does_not_fire() -> None:
    # 95 "ls" before, then a group calling "mv" 5 times: 5 / 100 = exactly theta.
    finding, state = _rare_after({"ls": 95}, [["mv"]] * 5, MonitorConfig(rare_min_actions=1))
    assert state.unigram_total == 100
    assert finding is None


def test_rare_just_under_theta_fires() -> None:
    finding, _ = _rare_after({"ls": 96}, [["mv"]] * 4, MonitorConfig(rare_min_actions=1))
    assert finding is not None
    assert finding.evidence["pattern"] == "mv"
    assert finding.evidence["count"] == 4 and finding.evidence["total"] == 100
    assert finding.evidence["frequency"] == pytest.approx(0.04)


def test_rare_pair_pattern_fires_when_both_names_are_common() -> None:
    # "cd" and "ls" are common, and "cd->ls" is common too; "ls->cd" is seen once.
    history = MonitorState()
    count_patterns(history, [["cd", "ls"]] * 60)
    recorded = group([1.0], calls=[["ls", "cd"]])
    count_patterns(history, (trajectory_actions(t) for t in recorded.trajectories))
    finding = detect_rare(recorded, history, MonitorConfig(rare_min_actions=1))
    assert finding is not None
    assert finding.evidence["pattern"] == "ls->cd" and finding.evidence["order"] == 2
    assert finding.evidence["count"] == 1 and finding.evidence["total"] == 61


def test_rare_warm_up() -> None:
    """Before ``rare_min_actions`` calls were counted, nothing is rare; at it, it is."""
    config = MonitorConfig(rare_min_actions=100)
    too_early, _ = _rare_after({"ls": 98}, [["mv"]], config)  # 99 actions
    assert too_early is None
    at_warm_up, _ = _rare_after({"ls": 99}, [["mv"]], config)  # 100 actions
    assert at_warm_up is not None


def test_rare_counts_accumulate_in_the_monitor() -> None:
    monitor = SignalMonitor(MonitorConfig(kinds=("rare",), rare_min_actions=50))
    for _ in range(10):
        assert monitor.process(group([1.0] * 5, calls=[["ls"]] * 5), TASK, now=0.0) == []
    signals = monitor.process(group([0.0], calls=[["ls", "mv"]]), TASK, now=0.0)
    assert [s.kind for s in signals] == ["rare"]
    assert signals[0].evidence["pattern"] == "mv"
    assert monitor.state.unigram_counts == {"ls": 51, "mv": 1}


def test_a_refused_call_is_not_a_rare_action() -> None:
    """A hallucinated function the environment refused never becomes a rare pattern."""
    monitor = SignalMonitor(MonitorConfig(kinds=("rare",), rare_min_actions=50))
    for _ in range(10):
        assert monitor.process(group([1.0] * 5, calls=[["ls"]] * 5), TASK, now=0.0) == []
    hallucinated = RolloutGroup(
        id="group-hallucinated",
        task_id=TASK.id,
        origin="seed",
        policy_version=3,
        trajectories=[trajectory(0.0, calls=["ls"], refused=["trading_check_stock_info"])],
    )
    assert monitor.process(hallucinated, TASK, now=0.0) == []
    assert "trading_check_stock_info" not in monitor.state.unigram_counts
    assert monitor.state.unigram_counts == {"ls": 51}


def test_rare_reads_the_environments_executed_calls() -> None:
    """Through the real BFCL environment: an unknown function is refused and not counted,
    a real one is executed and counted."""
    env = BfclEnvironment()
    env.reset(load_turn_tasks("multi_turn_base")[0])
    unknown = env.step(
        '<tool_call>{"name": "trading_check_stock_info", "arguments": {}}</tool_call>'
    )
    real = env.step('<tool_call>{"name": "pwd", "arguments": {}}</tool_call>')
    assert unknown.info["calls"] == [] and unknown.info["errors"]
    assert real.info["calls"] == ["pwd"]
    recorded = trajectory(0.0)
    recorded = msgspec.structs.replace(
        recorded, actions=[*unknown.info["calls"], *real.info["calls"]]
    )
    assert trajectory_actions(recorded) == ["pwd"]


def test_actions_fall_back_to_call_strings() -> None:
    bare = untokenized_trajectory(
        "t", TASK.id, actions=["cd(folder='docs')", "mv(source='a', destination='b')"]
    )
    assert trajectory_actions(bare) == ["cd", "mv"]


# --------------------------------------------------------------------------- uncertainty


def _state_with_entropies(values: list[float]) -> MonitorState:
    state = MonitorState()
    state.entropy_reservoir = list(values)
    state.entropy_seen = len(values)
    return state


def test_quantile_matches_numpy() -> None:
    values = list(np.random.default_rng(0).gamma(2.0, 0.5, size=137))
    for q in (0.0, 0.1, 0.5, 0.9, 0.95, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_uncertainty_threshold_edges() -> None:
    history = [i / 100 for i in range(101)]  # 0.00 .. 1.00; the 0.9 quantile is 0.90
    config = MonitorConfig(uncertainty_min_samples=10)
    cut = quantile(history, 0.9)
    assert cut == pytest.approx(0.9)
    state = _state_with_entropies(history)

    exactly = group([0.0], entropies=[[cut, cut]])
    assert detect_uncertainty(exactly, state, config) is None
    below = group([0.0], entropies=[[cut - 1e-6]])
    assert detect_uncertainty(below, state, config) is None
    above = group([0.0, 0.0], entropies=[[0.1], [cut + 1e-6, cut + 1e-6]])
    finding = detect_uncertainty(above, state, config)
    assert finding is not None
    assert finding.trajectory is above.trajectories[1]
    assert finding.evidence["threshold"] == pytest.approx(cut)
    assert finding.evidence["mean_entropy"] == pytest.approx(cut + 1e-6)


def test_uncertainty_warm_up_and_missing_entropies() -> None:
    config = MonitorConfig(uncertainty_min_samples=50)
    high = group([0.0], entropies=[[5.0]])
    assert detect_uncertainty(high, _state_with_entropies([0.1] * 49), config) is None
    assert detect_uncertainty(high, _state_with_entropies([0.1] * 50), config) is not None
    assert detect_uncertainty(group([0.0]), _state_with_entropies([0.1] * 50), config) is None


def test_uncertainty_compares_against_history_before_the_group() -> None:
    """A group's own entropies do not move the bar it is measured against."""
    state = _state_with_entropies([0.5] * 20)
    config = MonitorConfig(kinds=("uncertainty",), uncertainty_min_samples=20)
    recorded = group([0.0] * 8, entropies=[[0.6]] * 8)
    assert [f.kind for f in detect(recorded, state, config)] == ["uncertainty"]
    assert state.entropy_seen == 28


def test_reservoir_stays_bounded() -> None:
    config = MonitorConfig(kinds=("uncertainty",), reservoir_size=64)
    monitor = SignalMonitor(config)
    for i in range(40):
        monitor.process(group([0.0] * 4, entropies=[[i / 40]] * 4), TASK, now=float(i))
    assert len(monitor.state.entropy_reservoir) == 64
    assert monitor.state.entropy_seen == 160


# --------------------------------------------------------------------------- the messages


def test_signal_message_carries_task_trajectory_and_evidence() -> None:
    recorded = group([1.0, 0.0], calls=[["cd", "mv"], ["ls"]])
    signals = SignalMonitor(MonitorConfig(kinds=("boundary",))).process(recorded, TASK, now=5.0)
    assert len(signals) == 1
    signal = signals[0]
    assert isinstance(signal, Signal)
    assert signal.task == TASK and signal.group_id == recorded.id
    assert signal.trajectory.id == recorded.trajectories[1].id
    assert signal.trajectory.messages == recorded.trajectories[1].messages
    assert signal.trajectory.token_ids == []  # token arrays are the learner's, not ours
    assert signal.policy_version == 3 and signal.created_at == 5.0
    assert signal.evidence["trajectory_reward"] == 0.0
    assert decode(encode(signal), Signal) == signal  # evidence survives the wire


def test_all_kinds_can_fire_on_one_group() -> None:
    config = MonitorConfig(rare_min_actions=1, uncertainty_min_samples=5, bucket_capacity=4)
    state = MonitorState(score_windows={TASK.id: [1.0]})
    count_patterns(state, [["ls"]] * 200)
    state.entropy_reservoir, state.entropy_seen = [0.1] * 5, 5
    recorded = group(
        [1.0, 0.0, 0.0], calls=[["ls"], ["ls"], ["rename"]], entropies=[[0.1], [0.1], [2.0]]
    )
    kinds = sorted(s.kind for s in SignalMonitor(config, state).process(recorded, TASK, now=0.0))
    assert kinds == ["boundary", "forgetting", "rare", "uncertainty"]


def test_group_for_another_task_is_refused() -> None:
    with pytest.raises(ValueError, match="not task-a"):
        SignalMonitor().process(group([1.0], task_id="task-b"), TASK)
