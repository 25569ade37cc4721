"""The message catalogue: round trips, tags, schema versions, clear decode errors."""

from __future__ import annotations

import msgspec
import pytest

from coevolve.shared import messages as m
from coevolve.shared.runtime.subjects import SIGNALS_ALL, STREAMS, signal_subject, stream_for


def test_every_message_round_trips_and_is_tagged() -> None:
    task = m.Task(id="t", environment="bfcl", user_turns=["hi"])
    traj = m.Trajectory(
        id="x",
        task_id="t",
        messages=[m.ChatMessage(role="user", content="hi")],
        token_ids=[1, 2],
        logprobs=[0.0, -0.5],
        loss_mask=[0, 1],
        reward=1.0,
        policy_version=2,
    )
    samples = [
        m.RolloutGroup(task_id="t", origin="seed", policy_version=2, trajectories=[traj]),
        m.Signal(kind="boundary", task=task, trajectory=traj, group_id="g", policy_version=2),
        m.Verdict(candidate_id="c", accepted=False, reasons=["bad"], task=task),
        m.Heartbeat(service="s", instance="i", pid=1, host="h", started_at=0.0),
    ]
    for message in samples:
        data = m.encode(message)
        assert m.decode(data, type(message)) == message
        assert type(m.decode_any(data)) is type(message)
        assert msgspec.msgpack.decode(data)["type"] == type(message).__name__


def test_wrong_type_and_garbage_give_readable_errors() -> None:
    heartbeat = m.encode(m.Heartbeat(service="s", instance="i", pid=1, host="h", started_at=0))
    with pytest.raises(m.DecodeError, match="not a valid Verdict"):
        m.decode(heartbeat, m.Verdict)
    with pytest.raises(m.DecodeError):
        m.decode(b"\xc1", m.Verdict)


def test_newer_schema_is_refused() -> None:
    data = m.encode(m.GetStats(schema=m.SCHEMA_VERSION + 1))
    with pytest.raises(m.DecodeError, match="newer"):
        m.decode(data, m.GetStats)


def test_content_hash_ignores_identity_and_lineage() -> None:
    a = m.Task(id="a", environment="bfcl", user_turns=["x"], origin="seed")
    b = m.Task(
        id="b",
        environment="bfcl",
        user_turns=["x"],
        origin="explored",
        lineage=m.Lineage(signal_id="s"),
    )
    c = m.Task(id="a", environment="bfcl", user_turns=["y"])
    assert a.content_hash() == b.content_hash() != c.content_hash()


def test_derived_ids_are_stable() -> None:
    assert m.derived_id("cand", "e1", 0) == m.derived_id("cand", "e1", 0)
    assert m.derived_id("cand", "e1", 0) != m.derived_id("cand", "e1", 1)


def test_subjects_are_prefixed_and_captured_by_one_stream() -> None:
    for spec in STREAMS:
        assert all(s.startswith("coevolve.") for s in spec.subjects)
    assert stream_for(signal_subject("rare")).subjects == (SIGNALS_ALL,)
    with pytest.raises(KeyError):
        stream_for("coevolve.nowhere")


def test_step_labels_are_optional_and_bounded() -> None:
    traj = m.Trajectory(
        id="x",
        task_id="t",
        messages=[],
        token_ids=[1, 2],
        logprobs=[0.0, -0.5],
        loss_mask=[0, 1],
        reward=0.0,
        policy_version=0,
    )
    group = m.RolloutGroup(task_id="t", origin="seed", policy_version=0, trajectories=[traj])
    # a group encoded before the fields existed: no key for them on the wire
    wire = msgspec.msgpack.decode(m.encode(group))
    assert "label_s" not in wire and "step_labels" not in wire["trajectories"][0]
    decoded = m.decode(msgspec.msgpack.encode(wire), m.RolloutGroup)
    assert decoded.trajectories[0].step_labels == [] and decoded.label_s == 0.0
    labelled = msgspec.structs.replace(
        group, trajectories=[msgspec.structs.replace(traj, step_labels=[-1])], label_s=1.5
    )
    assert m.decode(m.encode(labelled), m.RolloutGroup) == labelled
    wire["trajectories"][0]["step_labels"] = [2]
    with pytest.raises(m.DecodeError):
        m.decode(msgspec.msgpack.encode(wire), m.RolloutGroup)
