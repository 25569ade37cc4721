"""Bus benchmark: ~50 KB rollout groups through JetStream next to core NATS, same run.

Starts its own nats-server. For each transport it measures throughput (publish N as
fast as the transport allows, with a bounded window of outstanding JetStream acks,
until the consumer has them all) and latency (one message at a time, publish to
delivery in the consumer). JetStream uses the real ROLLOUT_GROUPS stream and the
learner's durable consumer configuration (file storage, acks).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from coevolve.bench import tables
from coevolve.shared.config import BusSettings
from coevolve.shared.messages import RolloutGroup, Timings, Trajectory, encode
from coevolve.shared.runtime.bus import Bus, consumer_config
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import BENCH_CORE, LEARNER_GROUPS_CONSUMER, ROLLOUT_GROUPS

SENT_AT = "Bench-Sent-At"


def sample_group(target_bytes: int = 50_000, group_size: int = 8) -> RolloutGroup:
    """A realistic group: K trajectories of token ids, log-probs and masks."""
    tokens = 1
    while True:
        trajectories = [
            Trajectory(
                id=f"traj-{k}",
                task_id="task",
                messages=[],
                token_ids=[(k * 7919 + i * 104729) % 49152 for i in range(tokens)],
                logprobs=[-0.5 - (i % 17) / 10 for i in range(tokens)],
                loss_mask=[int(i % 3 != 0) for i in range(tokens)],
                reward=k % 2,
                policy_version=3,
                timings=Timings(generate_s=1.0, environment_s=0.1, total_s=1.2),
            )
            for k in range(group_size)
        ]
        group = RolloutGroup(
            task_id="task", origin="seed", policy_version=3, trajectories=trajectories
        )
        if len(encode(group)) >= target_bytes:
            return group
        tokens = max(tokens + 1, int(tokens * target_bytes / max(len(encode(group)), 1)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def core_run(url: str, payload: bytes, count: int, paced: bool) -> tuple[float, list[float]]:
    nc = await nats.connect(url)
    received: list[float] = []
    latencies: list[float] = []
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        now = time.perf_counter()
        latencies.append(now - float(msg.headers[SENT_AT]))
        received.append(now)
        if len(received) == count:
            done.set()

    sub = await nc.subscribe(
        BENCH_CORE,
        cb=on_msg,
        pending_msgs_limit=count + 10,
        pending_bytes_limit=(count + 10) * (len(payload) + 512),
    )
    await nc.flush()
    start = time.perf_counter()
    for _ in range(count):
        await nc.publish(BENCH_CORE, payload, headers={SENT_AT: repr(time.perf_counter())})
        if paced:
            await nc.flush()
            while len(received) < _ + 1:
                await asyncio.sleep(0)
    await nc.flush()
    await asyncio.wait_for(done.wait(), 120)
    elapsed = received[-1] - start
    await sub.unsubscribe()
    await nc.close()
    return count / elapsed, latencies


async def jetstream_run(
    url: str, payload: bytes, count: int, paced: bool, window: int = 64
) -> tuple[float, list[float]]:
    bus = await Bus.connect(BusSettings(url=url), "bench")
    await bus.ensure_streams()
    await bus.js.add_consumer(
        LEARNER_GROUPS_CONSUMER.stream, consumer_config(LEARNER_GROUPS_CONSUMER)
    )
    pull = await bus.js.pull_subscribe_bind(
        LEARNER_GROUPS_CONSUMER.durable, stream=LEARNER_GROUPS_CONSUMER.stream
    )
    latencies: list[float] = []
    received: list[float] = []

    async def consume() -> None:
        while len(received) < count:
            try:
                msgs = await pull.fetch(batch=64 if not paced else 1, timeout=1)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                now = time.perf_counter()
                latencies.append(now - float((msg.headers or {})[SENT_AT]))
                received.append(now)
                await msg.ack()

    consumer = asyncio.create_task(consume())
    start = time.perf_counter()
    pending: set[asyncio.Task[Any]] = set()
    for i in range(count):
        headers = {SENT_AT: repr(time.perf_counter()), "Nats-Msg-Id": f"{paced}-{i}"}
        publish = bus.js.publish(ROLLOUT_GROUPS, payload, headers=headers, timeout=30)
        if paced:
            await publish
            while len(received) < i + 1:
                await asyncio.sleep(0)
            continue
        pending.add(asyncio.ensure_future(publish))
        if len(pending) >= window:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()
    if pending:
        await asyncio.gather(*pending)
    await asyncio.wait_for(consumer, 120)
    elapsed = received[-1] - start
    await bus.js.delete_consumer(LEARNER_GROUPS_CONSUMER.stream, LEARNER_GROUPS_CONSUMER.durable)
    await bus.close()
    return count / elapsed, latencies


async def measure(quick: bool) -> dict[str, Any]:
    burst, paced = (400, 200) if quick else (4000, 1000)
    payload = encode(sample_group())
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "nats") as server:
        core_tput, _ = await core_run(server.url, payload, burst, paced=False)
        _, core_lat = await core_run(server.url, payload, paced, paced=True)
        js_tput, _ = await jetstream_run(server.url, payload, burst, paced=False)
        _, js_lat = await jetstream_run(server.url, payload, paced, paced=True)
    ms = 1000.0
    result = {
        "benchmark": "bus",
        "quick": quick,
        "message_bytes": len(payload),
        "burst_messages": burst,
        "paced_messages": paced,
        "core": {
            "msgs_per_s": round(core_tput, 1),
            "mb_per_s": round(core_tput * len(payload) / 1e6, 1),
            "p50_ms": round(percentile(core_lat, 50) * ms, 3),
            "p99_ms": round(percentile(core_lat, 99) * ms, 3),
        },
        "jetstream": {
            "msgs_per_s": round(js_tput, 1),
            "mb_per_s": round(js_tput * len(payload) / 1e6, 1),
            "p50_ms": round(percentile(js_lat, 50) * ms, 3),
            "p99_ms": round(percentile(js_lat, 99) * ms, 3),
            "mean_ms": round(statistics.fmean(js_lat) * ms, 3),
        },
    }
    result["ratio_jetstream_over_core"] = {
        "throughput": round(js_tput / core_tput, 3),
        "p50_latency": round(percentile(js_lat, 50) / percentile(core_lat, 50), 2),
        "p99_latency": round(percentile(js_lat, 99) / percentile(core_lat, 99), 2),
    }
    return result


def run(quick: bool = False) -> dict[str, Any]:
    result = asyncio.run(measure(quick))
    ratio = result["ratio_jetstream_over_core"]
    tables.print_table(
        f"bus benchmark: {result['message_bytes']} B rollout groups",
        ("transport", "msgs/s", "MB/s", "p50 ms", "p99 ms"),
        [
            (name, *(result[name][key] for key in ("msgs_per_s", "mb_per_s", "p50_ms", "p99_ms")))
            for name in ("core", "jetstream")
        ],
        note=f"jetstream/core: throughput x{ratio['throughput']}, "
        f"p50 latency x{ratio['p50_latency']}, p99 latency x{ratio['p99_latency']}",
    )
    return result
