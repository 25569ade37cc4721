"""A synthetic run directory written with the real writers: PoolStore, SummaryWriter."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import (
    Lineage,
    RolloutResults,
    ScoreSample,
    SignalKind,
    Task,
    ToolCall,
    Verdict,
)

T0 = 1_800_000_000.0


def make_task(number: int, **fields: object) -> Task:
    return Task(
        id=f"task-{number}",
        environment="bfcl",
        user_turns=[f"Move report_{number}.txt into the archive folder."],
        initial_state={"GorillaFileSystem": {"root": {"workspace": {}}}},
        ground_truth=[[ToolCall(name="mv", arguments={"source": f"report_{number}.txt"})]],
        env_config={"involved_classes": ["GorillaFileSystem"]},
        **fields,  # type: ignore[arg-type]
    )


def span(service: str, name: str, start_s: float, seconds: float) -> str:
    start = int((T0 + start_s) * 1e9)
    record = {
        "name": name,
        "service": service,
        "start_ns": start,
        "end_ns": start + int(seconds * 1e9),
        "attributes": {},
    }
    return json.dumps(record) + "\n"


@dataclass(frozen=True)
class SyntheticRun:
    run_dir: Path
    rewards: tuple[float, ...] = (0.125, 0.25, 0.5)


@pytest.fixture
def pool_only_run(tmp_path: Path) -> Path:
    """A run that has only seeded its pool: nothing else happened yet."""
    run = tmp_path / "fresh"
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(i, created_at=0.0) for i in range(4)])
    return run


@pytest.fixture
def synthetic_run(tmp_path: Path) -> SyntheticRun:
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    run.mkdir()
    (run / "up.json").write_text(json.dumps({"at": T0, "pid": 1}))
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks([make_task(i, created_at=0.0) for i in range(5)])
        verdicts: list[tuple[float, bool, list[str], SignalKind]] = [
            (100, True, [], "boundary"),
            (200, False, ["duplicate of a pool task", "ground truth fails"], "rare"),
            (260, False, ["ground truth fails"], "boundary"),
            (300.0, True, [], "rare"),
        ]
        for number, (at, accepted, reasons, kind) in enumerate(verdicts, start=10):
            task = make_task(
                number,
                origin="synthesized",
                created_at=T0 + at - 30,  # the abstractor drafts it before the verdict
                lineage=Lineage(signal_kind=kind, signal_id=f"sig-{number}"),
            )
            store.record_verdict(
                Verdict(
                    candidate_id=f"cand-{number}",
                    accepted=accepted,
                    reasons=reasons,
                    task=task,
                    created_at=T0 + at,
                )
            )
        for group, scores in (("g1", (0.0, 1.0)), ("g2", (0.0, 0.0)), ("g3", (1.0, 1.0))):
            samples = [
                ScoreSample(task_id="task-0", policy_version=1, score=s, length=10) for s in scores
            ]
            store.record_results(RolloutResults(group_id=group, samples=samples))
    writer = SummaryWriter(str(run / "tensorboard" / "learner"))
    rewards = (0.125, 0.25, 0.5)
    for step, reward in enumerate(rewards, start=1):
        at = T0 + 60.0 * step
        for tag, value in (
            ("reward_mean", reward),
            ("kl", 0.01 * step),
            ("staleness_mean", 0.5),
            ("groups", 2.0),
            ("uniform_groups", 1.0 if step == 2 else 0.0),
            ("trained", 1.0),
            ("duration_s", 20.0),
        ):
            writer.add_scalar(f"learner/{tag}", value, step, walltime=at)
    # a step whose groups were all uniform: no update, logged under the last step number
    for tag, value in (
        ("reward_mean", 0.0),
        ("kl", 0.0),
        ("staleness_mean", 0.0),
        ("groups", 2.0),
        ("uniform_groups", 2.0),
        ("trained", 0.0),
        ("duration_s", 1.0),
    ):
        writer.add_scalar(f"learner/{tag}", value, 3, walltime=T0 + 200.0)
    writer.close()
    traces = run / "traces"
    traces.mkdir()
    (traces / "explorer-1-abcdef.jsonl").write_text(
        span("explorer", "explorer process coevolve.signals.boundary", 90, 30.0)
        + span("explorer", "explorer process coevolve.signals.rare", 150, 40.0)
        + span("explorer", "explorer process coevolve.signals.boundary", 240, 10.0)
        + "not json\n"
    )
    (traces / "judge-2-abcdef.jsonl").write_text(
        span("judge", "judge process coevolve.candidates", 95, 4.5)
    )
    state = run / "signal_monitor" / "state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"emitted": {"boundary": 4, "rare": 2}, "suppressed": {"rare": 3}}))
    (run / "policies").mkdir()
    for version in (1, 2, 3):
        (run / "policies" / f"v{version}.safetensors").write_bytes(b"weights")
    (run / "logs").mkdir()
    (run / "logs" / "judge.log").write_text(
        "2026-11-23 19:28:58,840 judge WARNING coevolve.services.judge: slow answer\n"
        "2026-11-23 19:29:58,840 judge ERROR asyncio: the first failure\n"
        "Traceback (most recent call last):\n"
        "2026-11-23 19:30:58,840 judge ERROR asyncio: the second failure\n"
    )
    return SyntheticRun(run, rewards)
