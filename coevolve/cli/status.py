"""``coevolve status``: services and their heartbeats, stream and consumer depths."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import typer
from nats.js.errors import NotFoundError

from coevolve.cli.events import progress_text
from coevolve.cli.options import ConfigOption, JsonOption, RunDirOption, settings_from
from coevolve.cli.sections import enabled_optional_services
from coevolve.report.exposure import status_exposure, status_line, status_record
from coevolve.services.evaluator.config import heldout_every
from coevolve.services.evaluator.scores import held_out_line, read_latest
from coevolve.shared.config import Settings
from coevolve.shared.messages import DecodeError, Heartbeat, decode
from coevolve.shared.runtime.bus import UNAVAILABLE, Bus, BusError
from coevolve.shared.runtime.subjects import (
    CONSUMERS,
    HEARTBEAT_BUCKET,
    OPTIONAL_SERVICES,
    SERVICES,
    STREAMS,
)
from coevolve.shared.task_sets import partial_path, read_partial, split_heldout
from coevolve.up_state import recorded_nats_url, supervised_services


def expected_services(settings: Settings) -> list[str]:
    """The services a run has: all but an optional one its configuration leaves off."""
    enabled = enabled_optional_services(settings)
    return [s for s in SERVICES if s not in OPTIONAL_SERVICES or s in enabled]


async def collect(
    bus: Bus, stale_after_s: float, expected: Sequence[str] = SERVICES
) -> dict[str, Any]:
    now = time.time()
    instances: list[dict[str, Any]] = []
    try:
        kv = await bus.js.key_value(HEARTBEAT_BUCKET)
        keys = await kv.keys()
    except (NotFoundError, Exception) as exc:  # no bucket / no keys yet
        if "no keys" not in str(exc).lower() and not isinstance(exc, NotFoundError):
            raise
        keys = []
    for key in keys:
        entry = await kv.get(key)
        try:
            beat = decode(entry.value or b"", Heartbeat)
        except DecodeError:
            continue
        age = max(0.0, now - beat.sent_at)
        instances.append(
            {
                "service": beat.service,
                "instance": beat.instance,
                "pid": beat.pid,
                "host": beat.host,
                "heartbeat_age_s": round(age, 3),
                "alive": age < stale_after_s,
                "phase": beat.phase,
                "progress_done": beat.progress_done,
                "progress_total": beat.progress_total,
                "detail": beat.detail,
                "uptime_s": round(now - beat.started_at, 1),
                "processed": beat.processed,
                "failed": beat.failed,
                "in_flight": beat.in_flight,
                "dead_lettered": beat.dead_lettered,
            }
        )
    streams = []
    unavailable: list[str] = []
    for spec in STREAMS:
        try:
            info = await bus.js.stream_info(spec.name)
        except NotFoundError:
            continue
        except UNAVAILABLE:  # a cluster electing a leader, or without quorum
            unavailable.append(spec.name)
            continue
        cluster = info.cluster
        peers = cluster.replicas or [] if cluster is not None else []
        streams.append(
            {
                "stream": spec.name,
                "messages": info.state.messages,
                "bytes": info.state.bytes,
                # on a cluster: the node leading the stream and the other copies' state
                "leader": cluster.leader if cluster is not None else None,
                "replicas": [
                    {"node": p.name, "current": bool(p.current), "offline": bool(p.offline)}
                    for p in peers
                ],
            }
        )
    consumers = []
    for consumer in CONSUMERS:
        try:
            cinfo = await bus.js.consumer_info(consumer.stream, consumer.durable)
        except NotFoundError:
            continue
        except UNAVAILABLE:
            unavailable.append(f"{consumer.stream}/{consumer.durable}")
            continue
        consumers.append(
            {
                "stream": consumer.stream,
                "consumer": consumer.durable,
                "pending": cinfo.num_pending,
                "ack_pending": cinfo.num_ack_pending,
                "redelivered": cinfo.num_redelivered,
            }
        )
    alive = {i["service"] for i in instances if i["alive"]}
    return {
        "services": sorted(instances, key=lambda i: (i["service"], i["instance"])),
        "missing": [s for s in expected if s not in alive],
        "streams": streams,
        "consumers": consumers,
        # streams and consumers no server answered for (no leader right now)
        "unavailable": unavailable,
    }


def service_lines(services: list[dict[str, Any]]) -> list[str]:
    """The services table: one instance a line, its phase and progress last."""
    lines = [
        f"{'service':<16}{'instance':<14}{'pid':>8}{'beat age':>10}{'done':>8}{'failed':>8}  phase"
    ]
    for i in services:
        phase = progress_text(i["phase"], i["progress_done"], i["progress_total"], i["detail"])
        stale = "" if i["alive"] else "  (stale)"
        lines.append(
            f"{i['service']:<16}{i['instance']:<14}{i['pid']:>8}{i['heartbeat_age_s']:>9.1f}s"
            f"{i['processed']:>8}{i['failed']:>8}  {phase}{stale}"
        )
    return lines


def d0_build_progress(settings: Settings) -> dict[str, Any] | None:
    """How far the D0 build of the run directory is (None: no build under way)."""
    path = settings.d0.path(settings.run_dir)
    partial = partial_path(path)
    if path.is_file() or not partial.is_file():
        return None
    records = read_partial(partial)
    accepted = [task for record in records for task in record.accepted]
    training, heldout = split_heldout(accepted, heldout_every(settings))
    return {
        "file": str(path),
        "explorations": len(records),
        "tasks_ready": len(training),
        "held_out": len(heldout),
        "first_tasks": settings.d0.tasks_before_training,
        "minutes": round(sum(record.seconds for record in records) / 60, 1),
    }


def d0_build_line(building: dict[str, Any]) -> str:
    return (
        f"D0 being built ({building['file']}): {building['explorations']} explorations in "
        f"{building['minutes']:g} min, {building['tasks_ready']} tasks ready"
        + (f" and {building['held_out']} held out" if building.get("held_out") else "")
        + f"; `up` starts the services at {building['first_tasks']}"
    )


def status(
    config: ConfigOption = None, run_dir: RunDirOption = None, json_output: JsonOption = False
) -> None:
    """Show each service instance with its phase, progress and heartbeat age, and
    stream/consumer depths, and the run's exposure (coevolve/report/exposure.py)."""
    settings = settings_from(config, run_dir)
    url = os.environ.get("NATS_URL") or recorded_nats_url(settings.run_dir) or settings.bus.url
    settings.bus.url = url
    settings.bus.connect_timeout_s = 3.0
    expected = expected_services(settings)

    async def query() -> dict[str, Any]:
        bus = await Bus.connect(settings.bus, name="coevolve-status")
        try:
            with anyio.fail_after(10):
                return await collect(bus, 5 * settings.runtime.heartbeat_interval_s, expected)
        finally:
            await bus.close()

    try:
        report = anyio.run(query)
    except (BusError, TimeoutError) as exc:
        building = d0_build_progress(settings)
        if building is None:
            typer.echo(f"error: {exc} (is `coevolve up` running? set NATS_URL)", err=True)
            raise typer.Exit(1) from exc
        # `up` discovers D0's first tasks before it starts NATS and the services
        typer.echo(json.dumps({"d0_build": building}) if json_output else d0_build_line(building))
        return
    report["nats_url"] = url
    supervised = supervised_services(settings.run_dir)
    report["supervisor"] = supervised
    report["held_back"] = {
        name: child.get("held_back_reason")
        for name, child in supervised.items()
        if child.get("state") == "held_back"
    }
    held_out = read_latest(settings.run_dir)
    report["held_out"] = msgspec.to_builtins(held_out) if held_out is not None else None
    exposure, pool_unread = status_exposure(settings.run_dir)
    report["exposure"] = status_record(exposure, pool_unread)
    if json_output:
        typer.echo(json.dumps(report))
        return
    typer.echo(f"NATS {url}")
    for line in service_lines(report["services"]):
        typer.echo(line)
    if report["missing"]:
        typer.echo(f"not running: {', '.join(report['missing'])}")
    for name, reason in report["held_back"].items():
        typer.echo(f"held back by the supervisor: {name}: {reason}")
    if held_out is not None:
        typer.echo(held_out_line(held_out))
    if exposure.learner_steps or pool_unread is None:
        typer.echo(status_line(exposure, pool_unread))
    typer.echo(f"\n{'stream':<28}{'messages':>10}{'bytes':>14}  leader  copies")
    for s in report["streams"]:
        copies = " ".join(
            f"{r['node']}({'offline' if r['offline'] else 'current' if r['current'] else 'behind'})"
            for r in s["replicas"]
        )
        typer.echo(
            f"{s['stream']:<28}{s['messages']:>10}{s['bytes']:>14}  {s['leader'] or '-':<6}  "
            f"{copies or '-'}"
        )
    if report["unavailable"]:
        typer.echo(
            "no leader right now (a cluster electing one, or without quorum): "
            + ", ".join(report["unavailable"])
        )
    typer.echo(f"\n{'consumer':<40}{'pending':>9}{'unacked':>9}{'redelivered':>13}")
    for c in report["consumers"]:
        name = f"{c['stream']}/{c['consumer']}"
        typer.echo(f"{name:<40}{c['pending']:>9}{c['ack_pending']:>9}{c['redelivered']:>13}")
