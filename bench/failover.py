"""Failover benchmark: ``coevolve up`` on a 3-node JetStream cluster that loses nodes.

The bench runs its own cluster (``NatsCluster``, 3 nodes on loopback, streams and buckets
with 3 copies; ``up`` uses it through ``NATS_URL`` and ``COEVOLVE_NATS_REPLICAS``) so it can
kill and restart nodes with their stores kept. Once groups flow:

1. the node leading the rollout-groups stream is killed (``kill -9``); ``failover_s`` is
   the time until a new group is published; the node is restarted ``RESTART_AFTER_S``
   later;
2. at ``QUORUM_AT`` of the run, the stream's leader and a second node are killed together:
   one node of three cannot form a quorum, so the streams take no writes. The services must
   say so (``quorum_loss_reported_by``: the services whose log says the cluster has lost
   quorum); both nodes come back after ``QUORUM_DOWN_S`` and ``recovered_s`` is the time
   from their restart until groups flow again.

Then ``up`` is stopped and the chaos benchmark's audit runs (``bench/chaos.py``):
``groups_lost``, ``duplicate_tasks``, ``duplicate_verdicts``, ``versions_non_monotonic``,
``services_alive_at_end``. Writes ``result.json`` under ``RUN_DIR/bench/failover-<stamp>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from coevolve.bench import tables
from coevolve.bench.chaos import (
    bench_run_dirs,
    run_audit,
    start_up,
    stop_and_audit,
    watch,
)
from coevolve.bus_tally import BusTally
from coevolve.harness import wait_for
from coevolve.run_figures import logs_mentioning, service_states
from coevolve.shared.config import REPLICAS_ENV, BusSettings
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsCluster, NatsServer
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS, stream_for

NODES = 3
RESTART_AFTER_S = 20.0
QUORUM_AT = 0.6
QUORUM_DOWN_S = 30.0
GROUPS_WAIT_S = 600.0  # the warm start comes first: groups flow after a few minutes
QUORUM_TEXT = "lost quorum"


@dataclass
class NodeFault:
    kind: str
    nodes: list[str]
    at_s: float
    restarted_at_s: float | None = None
    groups_flowing_again_s: float | None = None


async def stream_leader(url: str) -> str:
    bus = await Bus.connect(BusSettings(url=url, connect_timeout_s=30.0), "failover-bench")
    try:
        with anyio.fail_after(30):
            while True:
                with contextlib.suppress(Exception):
                    info = await bus.js.stream_info(stream_for(ROLLOUT_GROUPS).name)
                    if info.cluster is not None and info.cluster.leader:
                        return str(info.cluster.leader)
                await anyio.sleep(0.5)
    finally:
        await bus.close()


def kill_node(node: NatsServer) -> None:
    if node.process is not None and node.process.poll() is None:
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait(5)


async def until_groups_grow(view: BusTally, timeout_s: float) -> float | None:
    """Seconds until a group not seen before is published (None: not within the time)."""
    seen = len(view.groups)
    return await wait_for(lambda: len(view.groups) > seen, timeout_s)


async def lose_leader(cluster: NatsCluster, view: BusTally, at: Callable[[], float]) -> NodeFault:
    """Kill the rollout-groups stream's leader; restart it ``RESTART_AFTER_S`` later."""
    leader = cluster.node(await stream_leader(cluster.url))
    assert leader.cluster is not None
    fault = NodeFault("leader killed", [leader.cluster.node], at())
    kill_node(leader)
    fault.groups_flowing_again_s = await until_groups_grow(view, 300)
    await anyio.sleep(max(0.0, fault.at_s + RESTART_AFTER_S - at()))
    await anyio.to_thread.run_sync(leader.start)
    fault.restarted_at_s = at()
    return fault


async def lose_quorum(cluster: NatsCluster, view: BusTally, at: Callable[[], float]) -> NodeFault:
    """Kill the leader and a second node together, restart both ``QUORUM_DOWN_S`` later."""
    first = cluster.node(await stream_leader(cluster.url))
    second = next(n for n in cluster.nodes if n is not first)
    names = [n.cluster.node for n in (first, second) if n.cluster is not None]
    fault = NodeFault("quorum lost", names, at())
    kill_node(first)
    kill_node(second)
    await anyio.sleep(QUORUM_DOWN_S)
    for node in (first, second):
        await anyio.to_thread.run_sync(node.start)
    fault.restarted_at_s = at()
    fault.groups_flowing_again_s = await until_groups_grow(view, 300)
    return fault


async def failover(run_dir: Path, out_dir: Path, minutes: float) -> dict[str, Any]:
    cluster = NatsCluster(out_dir / "nats", NODES, log_dir=out_dir / "nats-logs")
    await anyio.to_thread.run_sync(cluster.start)
    view = BusTally()
    faults: list[NodeFault] = []
    alive_at_end: dict[str, str] = {}
    os.environ[REPLICAS_ENV] = str(NODES)  # up and its services keep 3 copies
    try:
        with start_up(run_dir, cluster.url, out_dir / "up.log") as up:

            def at() -> float:
                return round(up.elapsed_s(), 1)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, cluster.url, view, "failover-bench")
                if await wait_for(lambda: bool(view.groups), GROUPS_WAIT_S, 1.0) is not None:
                    faults.append(await lose_leader(cluster, view, at))
                    await anyio.sleep(max(0.0, QUORUM_AT * minutes * 60 - at()))
                    faults.append(await lose_quorum(cluster, view, at))
                await anyio.sleep(max(0.0, minutes * 60 - at()))
                alive_at_end = service_states(run_dir)
                tg.cancel_scope.cancel()
            bus_audit = await stop_and_audit(up, cluster.url, view)
    finally:
        os.environ.pop(REPLICAS_ENV, None)
        cluster.stop()
    first_fault = faults[0] if faults else None
    return {
        "benchmark": "failover",
        "minutes": minutes,
        "nodes": NODES,
        "faults": [asdict(f) for f in faults],
        "failover_s": first_fault.groups_flowing_again_s if first_fault else None,
        "quorum_loss_reported_by": logs_mentioning(run_dir, QUORUM_TEXT),
        "recovered_s": faults[1].groups_flowing_again_s if len(faults) > 1 else None,
        **run_audit(run_dir, view, bus_audit),
        "services_alive_at_end": alive_at_end,
        "shutdown": up.stop_report(),
    }


def run(quick: bool = False, minutes: float | None = None) -> dict[str, Any]:
    minutes = minutes if minutes is not None else (8.0 if quick else 20.0)
    out_dir, run_dir = bench_run_dirs("failover")
    result = anyio.run(failover, run_dir, out_dir, minutes)
    result["quick"] = quick
    result["run_dir"] = str(out_dir)
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    print_result(result)
    return result


def print_result(result: dict[str, Any]) -> None:
    tables.print_table(
        f"failover benchmark: {result['minutes']} min on {result['nodes']} nodes",
        ("at (s)", "fault", "restarted at (s)", "groups again after (s)"),
        [
            (
                f"{fault['at_s']:.1f}",
                f"{fault['kind']} ({', '.join(fault['nodes'])})",
                fault["restarted_at_s"],
                fault["groups_flowing_again_s"],
            )
            for fault in result["faults"]
        ],
        left=(1,),
    )
    keys = (
        "failover_s",
        "recovered_s",
        "quorum_loss_reported_by",
        "groups_published",
        "groups_trained",
        "groups_requeued",
        "groups_lost",
        "duplicate_tasks",
        "duplicate_verdicts",
        "versions_non_monotonic",
        "services_alive_at_end",
    )
    tables.print_table(None, ("audit", "value"), [(key, result[key]) for key in keys], left=(0, 1))
