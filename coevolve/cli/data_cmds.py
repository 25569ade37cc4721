"""``coevolve signals`` and ``coevolve tasks list|show|lineage``: watch the data loop.

``signals`` subscribes (core NATS, nothing is consumed) to ``coevolve.signals.>`` or one
kind and prints each signal as it is published: for ``--seconds`` (default 5), or until
Ctrl-C with ``--follow``. The signal stream is a work queue that explorers empty, so past
signals are not replayed; a task's signal is kept in its lineage (``tasks lineage``).

``tasks`` asks pool-store over request/reply and, when no pool-store answers (or NATS is
down), opens the DuckDB file read-only instead (possible only while no pool-store holds it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import anyio
import msgspec
import nats.errors
import typer

from coevolve.cli.options import ConfigOption, RunDirOption, settings_from
from coevolve.shared.config import Settings
from coevolve.shared.messages import ORIGINS, SIGNAL_KINDS, DecodeError, Signal, Task, decode
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.bus import Bus, BusError
from coevolve.shared.runtime.subjects import SIGNALS_ALL, signal_subject
from coevolve.up_state import recorded_nats_url

T = TypeVar("T")

JsonLines = Annotated[
    bool, typer.Option("--json", help="Print JSON (one object per line for signals).")
]
TaskIdArgument = Annotated[str, typer.Argument(help="Task id.")]


def connect_settings(config: Any, run_dir: Any) -> Settings:
    settings = settings_from(config, run_dir)
    url = os.environ.get("NATS_URL") or recorded_nats_url(settings.run_dir) or settings.bus.url
    settings.bus.url = url
    settings.bus.connect_timeout_s = min(settings.bus.connect_timeout_s, 3.0)
    return settings


# --------------------------------------------------------------------------- signals


def signal_record(signal: Signal) -> dict[str, Any]:
    """What ``signals --json`` prints for one signal (the trajectory's messages left out)."""
    return {
        "id": signal.id,
        "kind": signal.kind,
        "task_id": signal.task.id,
        "task_origin": signal.task.origin,
        "group_id": signal.group_id,
        "policy_version": signal.policy_version,
        "trajectory_id": signal.trajectory.id,
        "trajectory_reward": signal.trajectory.reward,
        "evidence": signal.evidence,
        "created_at": signal.created_at,
    }


def signal_line(signal: Signal) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(signal.created_at))
    evidence = " ".join(
        f"{key}={_short(value)}"
        for key, value in signal.evidence.items()
        if isinstance(value, str | int | float | bool)
    )
    return (
        f"{stamp}  {signal.kind:<11} task={signal.task.id}  "
        f"reward={signal.trajectory.reward:.2f}  v{signal.policy_version}  {evidence}"
    )


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."


async def watch_signals(
    settings: Settings,
    subject: str,
    on_signal: Callable[[Signal], None],
    seconds: float | None,
) -> int:
    """Print signals on ``subject`` for ``seconds`` (forever when None); returns the count."""
    bus = await Bus.connect(settings.bus, name="coevolve-signals")
    count = 0
    try:
        subscription = await bus.nc.subscribe(subject)
        # the iterator, not next_msg(timeout), which can lose a message as it times out
        with anyio.move_on_after(seconds):
            async for msg in subscription.messages:
                try:
                    signal = decode(msg.data, Signal)
                except DecodeError as exc:
                    typer.echo(f"(undecodable message on {msg.subject}: {exc})", err=True)
                    continue
                on_signal(signal)
                count += 1
        await subscription.unsubscribe()
    finally:
        await bus.close(timeout=2)
    return count


def signals(
    kind: Annotated[
        str | None,
        typer.Option("--kind", "-k", help=f"Only one kind: {', '.join(SIGNAL_KINDS)}."),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until Ctrl-C.")
    ] = False,
    seconds: Annotated[
        float, typer.Option("--seconds", help="Without --follow: how long to listen.")
    ] = 5.0,
    json_output: JsonLines = False,
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """Print signals as the signal monitor publishes them (live; nothing is consumed)."""
    if kind is not None and kind not in SIGNAL_KINDS:
        raise typer.BadParameter(f"unknown kind {kind!r}; choose from {', '.join(SIGNAL_KINDS)}")
    settings = connect_settings(config, run_dir)
    subject = signal_subject(kind) if kind else SIGNALS_ALL

    def show(signal: Signal) -> None:
        text = json.dumps(signal_record(signal)) if json_output else signal_line(signal)
        typer.echo(text)
        sys.stdout.flush()

    try:
        count = anyio.run(watch_signals, settings, subject, show, None if follow else seconds)
    except KeyboardInterrupt:
        return
    except BusError as exc:
        typer.echo(f"error: {exc} (is `coevolve up` running? set NATS_URL)", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"{count} signal(s) on {subject} in {seconds:g} s", err=True)


# --------------------------------------------------------------------------- tasks


class PoolUnavailable(RuntimeError):
    """Neither pool-store nor its DuckDB file could answer."""


async def _ask_pool(settings: Settings, call: Callable[[PoolClient], Awaitable[T]]) -> T:
    bus = await Bus.connect(settings.bus, name="coevolve-tasks")
    try:
        with anyio.fail_after(settings.bus.request_timeout_s + 2):
            return await call(PoolClient(bus))
    finally:
        await bus.close(timeout=2)


def _from_pool_or_file(
    settings: Settings,
    via_pool: Callable[[PoolClient], Awaitable[T]],
    via_file: Callable[[Any], T],
) -> T:
    """Ask pool-store; when none answers, read the DuckDB file read-only."""
    try:
        return anyio.run(_ask_pool, settings, via_pool)
    except (BusError, TimeoutError, nats.errors.NoRespondersError, nats.errors.TimeoutError):
        pass
    from coevolve.services.pool_store.config import PoolStoreConfig
    from coevolve.services.pool_store.store import PoolStore

    db_file = settings.run_dir / settings.section("pool_store", PoolStoreConfig).db_file
    try:
        store = PoolStore.open_readonly(db_file)
    except Exception as exc:
        raise PoolUnavailable(f"no pool-store answers and {db_file} cannot be read: {exc}") from exc
    typer.echo(f"(no pool-store answering; read {db_file})", err=True)
    with store:
        return via_file(store)


def run_on_pool_or_file(
    settings: Settings, via_pool: Callable[[PoolClient], Awaitable[T]], via_file: Any
) -> T:
    try:
        return _from_pool_or_file(settings, via_pool, via_file)
    except PoolUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


tasks_app = typer.Typer(
    name="tasks",
    help="Inspect the task pool: list tasks, show one, show its lineage.",
    no_args_is_help=True,
    add_completion=False,
)


@tasks_app.command("list")
def list_tasks(
    origin: Annotated[
        str | None, typer.Option("--origin", help=f"Only one origin: {', '.join(ORIGINS)}.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=2000)] = 20,
    json_output: JsonLines = False,
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """Tasks of the pool: the newest first from the DuckDB file, or, while pool-store runs
    (it holds the file), a random sample of active tasks, with counts by origin."""
    if origin is not None and origin not in ORIGINS:
        raise typer.BadParameter(f"unknown origin {origin!r}; choose from {', '.join(ORIGINS)}")
    settings = connect_settings(config, run_dir)

    async def via_pool(pool: PoolClient) -> dict[str, Any]:
        stats = await pool.stats()
        mix: dict[str, float] = {origin: 1.0} if origin else {}
        available = stats.tasks_by_origin.get(origin, 0) if origin else 1
        tasks = await pool.sample(limit, mix=mix, seed=0) if available else []
        unique = list({task.id: task for task in tasks}.values())
        return {"source": "pool-store sample", "counts": stats.tasks_by_origin, "tasks": unique}

    def via_file(store: Any) -> dict[str, Any]:
        stats = store.stats()
        tasks = store.list_tasks(origin=origin, limit=limit)
        return {"source": "duckdb newest", "counts": stats.tasks_by_origin, "tasks": tasks}

    listing = run_on_pool_or_file(settings, via_pool, via_file)
    tasks: list[Task] = listing["tasks"]
    if json_output:
        typer.echo(
            json.dumps(
                {
                    "source": listing["source"],
                    "counts": listing["counts"],
                    "tasks": [_task_summary(task) for task in tasks],
                }
            )
        )
        return
    counts = ", ".join(f"{name} {count}" for name, count in listing["counts"].items())
    typer.echo(f"pool: {counts}  ({listing['source']})")
    typer.echo(f"{'id':<34}{'origin':<13}{'status':<9}{'turns':>5}  description / first turn")
    for task in tasks:
        text = task.description or (task.user_turns[0] if task.user_turns else "")
        typer.echo(
            f"{task.id:<34}{task.origin:<13}{task.status:<9}{len(task.user_turns):>5}  "
            f"{_one_line(text, 70)}"
        )


def _one_task_command(
    name: str,
    summary: str,
    via_pool: Callable[[PoolClient, str], Awaitable[T | None]],
    via_file: Callable[[Any, str], T | None],
    as_json: Callable[[T], Any],
    as_lines: Callable[[T], list[str]],
) -> None:
    """Adds ``tasks NAME TASK_ID``: what the pool holds of one task, as text or as JSON;
    it exits with an error when the pool holds nothing."""

    @tasks_app.command(name, help=summary)
    def command(
        task_id: TaskIdArgument,
        json_output: JsonLines = False,
        config: ConfigOption = None,
        run_dir: RunDirOption = None,
    ) -> None:
        settings = connect_settings(config, run_dir)
        found = run_on_pool_or_file(
            settings, lambda pool: via_pool(pool, task_id), lambda store: via_file(store, task_id)
        )
        if not found:
            typer.echo(f"error: no task {task_id!r} in the pool", err=True)
            raise typer.Exit(1)
        if json_output:
            typer.echo(json.dumps(as_json(found)))
            return
        for line in as_lines(found):
            typer.echo(line)


def task_lines(task: Task) -> list[str]:
    """One task as text: its user turns, each with its expected calls."""
    lines = [f"task {task.id}  ({task.origin}, {task.environment}, {task.status})"]
    if task.description:
        lines.append(f"description: {task.description}")
    for number, turn in enumerate(task.user_turns, start=1):
        lines.append(f"turn {number}: {_one_line(turn, 300)}")
        calls = task.ground_truth[number - 1] if number - 1 < len(task.ground_truth) else []
        lines.extend(
            f"    {call.name}({json.dumps(call.arguments, ensure_ascii=False)})" for call in calls
        )
    if task.lineage.signal_id or task.lineage.exploration_id:
        lines.append(f"lineage: see `coevolve tasks lineage {task.id}`")
    return lines


async def _lineage_chain(pool: PoolClient, task_id: str) -> dict[str, Any]:
    return (await pool.lineage(task_id)).chain


def lineage_lines(chain: dict[str, Any]) -> list[str]:
    """The chain as text, one stage per block."""
    lines = [
        f"task         {chain['task_id']}  ({chain.get('origin')}, {chain.get('environment')})",
    ]
    if chain.get("description"):
        lines.append(f"             {_one_line(chain['description'], 100)}")
    lines.append(f"trace        {chain.get('trace_id') or '-'}")
    signal = chain.get("signal")
    if signal is None:
        lines.append("signal       - (not from a signal)")
    else:
        evidence = " ".join(
            f"{k}={_short(v)}"
            for k, v in (signal.get("evidence") or {}).items()
            if isinstance(v, str | int | float | bool)
        )
        lines.append(
            f"signal       {signal['id']}  {signal.get('kind')}  "
            f"from task {signal.get('parent_task_id')}"
        )
        if evidence:
            lines.append(f"             {evidence}")
    context = chain.get("context")
    if context is None:
        lines.append("context      -")
    else:
        lines.append(f"context      summary: {_one_line(context['summary'], 100)}")
        lines.append(f"             failure cause: {_one_line(context['failure_cause'], 100)}")
        lines.append(f"             focus: {'; '.join(context.get('focus_pattern') or [])}")
        avoid = "; ".join(context.get("mistakes_to_avoid") or [])
        if avoid:
            lines.append(f"             avoid: {avoid}")
    exploration = chain.get("exploration")
    lines.append(
        "exploration  -"
        if exploration is None
        else f"exploration  {exploration['id']}  {exploration.get('mode')}, "
        f"{exploration.get('steps')} steps"
    )
    candidate = chain.get("candidate")
    lines.append(f"candidate    {candidate['id'] if candidate else '-'}")
    verdict = chain.get("verdict")
    if verdict is None:
        lines.append("verdict      -")
    else:
        state = "accepted" if verdict.get("accepted") else "rejected"
        lines.append(f"verdict      {verdict['id']}  {state}")
        for reason in verdict.get("reasons") or []:
            lines.append(f"             - {_one_line(reason, 100)}")
    return lines


def _task_summary(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "origin": task.origin,
        "environment": task.environment,
        "status": task.status,
        "description": task.description,
        "user_turns": task.user_turns,
        "signal_kind": task.lineage.signal_kind,
        "trace_id": task.lineage.trace_id,
    }


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_one_task_command(
    "show",
    "One task: its user turns, ground truth and origin.",
    PoolClient.get,
    lambda store, task_id: store.get_task(task_id),
    msgspec.to_builtins,
    task_lines,
)
_one_task_command(
    "lineage",
    "How a task came to be: signal -> context -> exploration -> candidate -> verdict.",
    _lineage_chain,
    lambda store, task_id: store.lineage(task_id),
    lambda chain: chain,
    lineage_lines,
)
