"""The arm controller on a real NATS server: marks, counted tasks, paced requests, and the
labelled_control arm's turns paced by the learner's steps, into a real pool-store."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from coevolve.experiment.ablation import (
    ArmLive,
    ExperimentSpec,
    LabelledFeed,
    Pacer,
    control_arm,
    labelled_control_tasks,
)
from coevolve.report.run_data import load_run
from coevolve.report.run_report import summarize_run
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import labelled_tasks_in, rollout_jobs
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import BusSettings, Settings
from coevolve.shared.messages import ExplorationRequest, TaskAdded, decode, encode
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import EXPLORATION_REQUESTS, TASK_ADDED
from coevolve.shared.task_sets import load_d0
from tests.support.harness import standin_up
from tests.support.pool_store import pool_answering, pool_store_in_portal
from tests.support.wait import wait_until

D0_FILE = Path(__file__).parents[2] / "docs" / "results" / "d0-20261129.json"


async def drive(
    url: str, run: Path, spec: ExperimentSpec, pacer: Pacer
) -> tuple[ArmLive, list[ExplorationRequest]]:
    requests: list[ExplorationRequest] = []
    result: list[ArmLive] = []
    bus = await Bus.connect(BusSettings(url=url), name="test")
    try:
        await pool_answering(bus, seeded=True)  # the random arm varies the pool's tasks
        subscription = await bus.nc.subscribe(EXPLORATION_REQUESTS)

        async def collect() -> None:
            async for message in subscription.messages:
                requests.append(decode(message.data, ExplorationRequest))

        async def control() -> None:
            started = time.monotonic()
            result.append(await control_arm(url, run, run / "marks", spec, started, pacer, 3))

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            tg.start_soon(control)
            # its first paced requests come after it subscribed to the task events
            await wait_until(lambda: requests, 60, "the arm's first requests", poll_s=0.05)
            for origin in ("seed", "synthesized"):
                await bus.nc.publish(TASK_ADDED, encode(TaskAdded(task_id="t", origin=origin)))
            await wait_until(lambda: result, 120, "the arm to finish", poll_s=0.1)
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
    return result[0], requests


def test_controller_keeps_policies_counts_tasks_and_paces(
    nats_server: NatsServer, settings: Settings, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    (run / "policies").mkdir(parents=True)
    for version in (1, 2):
        (run / "policies" / f"v{version}.safetensors").write_bytes(f"v{version}".encode())
    spec = ExperimentSpec(("random", "coevolve"), (3,), minutes=0.05)
    pacer = Pacer([0.0, 0.0, 0.0], lead_minutes=0.0, max_in_flight=2)

    settings.services = {"pool_store": {"feed_jobs": False}}
    with pool_store_in_portal(settings):
        live, requests = anyio.run(drive, nats_server.url, run, spec, pacer)

    assert live.mark_versions == {}  # 3 s: no 10-minute mark before the end
    assert (live.ended_by, live.end_version) == ("minutes", 2)
    assert live.end_minute >= 0.05
    assert (run / "marks" / "v2.safetensors").read_bytes() == b"v2"
    assert len(live.added_minutes) == 1  # the seed task is not growth
    assert pacer.added == 1
    assert live.requests_sent == len(requests) == 2  # three due, at most two in flight
    for request in requests:  # labelled train turns of the pool, to vary
        assert request.vary and request.task.origin == "seed"
        assert request.task.user_turns and request.task.ground_truth


def test_with_no_labels_the_random_arm_varies_discovered_tasks(
    nats_server: NatsServer, settings: Settings, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    (run / "policies").mkdir(parents=True)
    (run / "policies" / "v1.safetensors").write_bytes(b"v1")
    config = tmp_path / "no-labels.yaml"
    config.write_text("labels: none\nd0: {file: docs/results/d0-20261129.json}\n")
    spec = ExperimentSpec(("random",), (3,), minutes=0.05, base_config=str(config))
    pacer = Pacer([0.0, 0.0], lead_minutes=0.0, max_in_flight=2)

    settings.labels = "none"
    settings.d0.file = str(D0_FILE)
    settings.services = {"pool_store": {"feed_jobs": False}}
    with pool_store_in_portal(settings):
        live, requests = anyio.run(drive, nats_server.url, run, spec, pacer)

    assert spec.setting() == "no_labels" and live.requests_sent == len(requests) == 2
    d0 = {task.id for task in load_d0(D0_FILE).tasks}
    for request in requests:  # D0's discovered tasks, never a labelled turn
        assert request.vary and request.task.id in d0 and request.task.origin == "explored"


def test_an_arm_ends_after_its_learner_steps(nats_server: NatsServer, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "policies").mkdir(parents=True)
    for version in (1, 2, 3):  # v3: the policy after two steps
        (run / "policies" / f"v{version}.safetensors").write_bytes(f"v{version}".encode())
    spec = ExperimentSpec(("none",), (0,), minutes=30.0, steps=2)

    lines: list[str] = []
    with standin_up(tmp_path / "up-run", tmp_path / "up.log") as up:
        live = anyio.run(
            functools.partial(
                control_arm, up=up, progress=lines.append, progress_every_minutes=0.0
            ),
            nats_server.url,
            run,
            run / "marks",
            spec,
            time.monotonic(),
            None,
            0,
        )

    assert (live.ended_by, live.end_version) == ("steps", 3)
    assert live.end_minute < 1.0
    assert (run / "marks" / "v3.safetensors").read_bytes() == b"v3"
    assert live.cpu is up.cpu and live.cpu.totals()  # the run's processes, sampled
    assert lines and re.fullmatch(
        r"minute \d+\.\d of 30: policy v3 after 2 of 2 learner steps, 0 tasks added, "
        r"\d+\.\d CPU minutes",
        lines[0],
    ), lines


def publish_policy(run: Path, version: int) -> None:
    (run / "policies" / f"v{version}.safetensors").write_bytes(f"v{version}".encode())


async def drive_labelled_control(
    url: str, run: Path, spec: ExperimentSpec, feed: LabelledFeed
) -> tuple[ArmLive, list[int]]:
    """The arm's controller while the "learner" publishes v3, v4 and v5; the labelled turns
    in the pool after each step, once the controller has had time to add more."""
    result: list[ArmLive] = []
    in_pool: list[int] = []
    bus = await Bus.connect(BusSettings(url=url), name="test")
    try:
        client = await pool_answering(bus, seeded=True)

        async def labelled() -> int:
            return (await client.stats()).tasks_by_origin["seed"]

        async def control() -> None:
            started = time.monotonic()
            live = await control_arm(
                url, run, run / "marks", spec, started, None, 5, labelled_feed=feed, tick_s=0.1
            )
            result.append(live)

        async with anyio.create_task_group() as tg:
            tg.start_soon(control)
            for version, owed in ((3, 4), (4, 6)):
                await anyio.sleep(1.0)  # many ticks: none adds more than is owed
                in_pool.append(await labelled())
                publish_policy(run, version)
                await wait_until(functools.partial(_at_least, labelled, owed), 60, f"{owed} turns")
            await anyio.sleep(1.0)
            in_pool.append(await labelled())
            publish_policy(run, 5)  # the fourth step: the arm's last
            await wait_until(lambda: result, 60, "the arm to end", poll_s=0.1)
            tg.cancel_scope.cancel()
    finally:
        await bus.close()
    return result[0], in_pool


async def _at_least(count: Callable[[], Awaitable[int]], wanted: int) -> bool:
    return await count() >= wanted


def test_the_labelled_control_arm_adds_labelled_turns_at_the_pace_and_they_are_fed_first(
    nats_server: NatsServer, settings: Settings, tmp_path: Path
) -> None:
    run = tmp_path / "arm"
    (run / "policies").mkdir(parents=True)
    for version in (1, 2):  # the warm start and one step: nothing owed in the grace step
        publish_policy(run, version)
    config = tmp_path / "no-labels.yaml"
    config.write_text(
        "labels: none\nd0: {file: docs/results/d0-20261129.json}\n"
        "pacing: {tasks_per_step: 2, grace_steps: 1}\n"
    )
    spec = ExperimentSpec(("labelled_control",), (5,), 10.0, steps=4, base_config=str(config))
    turns = labelled_control_tasks(spec, 5)
    feed = LabelledFeed(turns, spec.pacing())

    settings.labels = "none"
    settings.d0.file = str(D0_FILE)
    settings.services = {"pool_store": {"feed_jobs": False}}
    with pool_store_in_portal(settings):
        live, in_pool = anyio.run(drive_labelled_control, nats_server.url, run, spec, feed)

    # owed: 2 a step, the grace step's too, once it is done; counted from the policies
    assert in_pool == [0, 4, 6]
    assert (live.ended_by, live.end_version) == ("steps", 5)
    assert len(live.added_minutes) == live.labelled_sent == 6
    # BFCL's train turns of the world, in the order the arm's seed fixes
    assert all(t.origin == "seed" and t.ground_truth and t.user_turns for t in turns)
    assert [t.id for t in labelled_control_tasks(spec, 6)] != [t.id for t in turns]
    added = [t.id for t in turns[:6]]
    with PoolStore(settings.run_dir / "pool.duckdb") as store:
        assert store.fresh_tasks() == added
        assert labelled_tasks_in(store) == 0  # the pool was seeded with D0 alone
        jobs = rollout_jobs(store, 8, PoolStoreConfig(), queue_seq=0, first_round=0)
        assert [job.task.id for job in jobs[:6]] == added  # fed first, as fresh children are
        assert all(job.task.lineage.labelled_control for job in jobs[:6])
        assert all(job.task.origin == "explored" for job in jobs[6:])  # then D0's tasks
    # the run's report counts them as tasks the run added, D0 as its starting pool
    summary = summarize_run(load_run(settings.run_dir))
    assert summary.tasks_added == 6 and summary.pool_by_origin["seed"] == 6
