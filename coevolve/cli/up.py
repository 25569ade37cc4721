"""``coevolve up``: NATS (unless NATS_URL is set) and every service, supervised."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import anyio
import msgspec
import typer

from coevolve.cli.discover_cmd import ensure_d0
from coevolve.cli.events import EventPrinter, EventTracker, EventWatcherThread
from coevolve.cli.options import ConfigOption, RunDirOption, settings_from
from coevolve.cli.sections import (
    check_sections,
    enabled_optional_services,
    step_credit_enabled,
)
from coevolve.schedules.synthesis import DEFAULT_MAX_SIGNALS
from coevolve.shared.config import (
    D0_FILE_ENV,
    LABELS_ENV,
    NATS_CREDENTIALS_DIR,
    PACING_ENV,
    REPLICAS_ENV,
    BusSettings,
    ConfigError,
    Settings,
)
from coevolve.shared.llm.run_server import start_for_run
from coevolve.shared.llm.server import LlamaServer, LLMServerError
from coevolve.shared.runtime.actor import STOP_AFTER_DRAIN_S
from coevolve.shared.runtime.bus import BusError, declare_streams
from coevolve.shared.runtime.credentials import (
    CREDENTIALS_DIR_ENV,
    new_credentials,
    service_environment,
    write_credentials,
)
from coevolve.shared.runtime.nats_server import NatsCluster, NatsServer, NatsServerError
from coevolve.shared.runtime.subjects import BACKGROUND_SERVICES, OPTIONAL_SERVICES, SERVICES
from coevolve.shared.runtime.supervisor import ChildSpec, Supervisor
from coevolve.up_state import SUPERVISOR_FILE, record_up

# past a service's drain: its own limits after the drain, and a second for signals and exit
STOP_MARGIN_S = STOP_AFTER_DRAIN_S + 1.0


def parse_scale(values: list[str], enabled: set[str] | None = None) -> dict[str, int]:
    """Replicas per service: 1, or 0 for an optional service not in ``enabled``, unless
    --scale says otherwise."""
    replicas = {
        name: 0 if name in OPTIONAL_SERVICES and name not in (enabled or set()) else 1
        for name in SERVICES
    }
    for value in values:
        name, _, count = value.partition("=")
        name = name.replace("-", "_")
        if name not in SERVICES or not count.isdigit():
            raise typer.BadParameter(f"--scale takes SERVICE=N with SERVICE in {SERVICES}: {value}")
        replicas[name] = int(count)
    return replicas


NatsPortOption = Annotated[
    int, typer.Option(help="Port of the NATS server started for you (0: any free port).")
]
NatsClusterOption = Annotated[
    int,
    typer.Option(
        help="Start a JetStream cluster of this many nats-server nodes on loopback instead "
        "of one server; every stream and bucket then keeps that many copies (3 survives "
        "losing a node). --nats-port is then unused: the nodes take free ports.",
        min=1,
        max=5,
    ),
]
ScaleOption = Annotated[
    list[str] | None,
    typer.Option(help="Replicas of a service, e.g. --scale explorer=3 (repeatable)."),
]
ScheduleOption = Annotated[
    str,
    typer.Option(
        help="async: every service runs continuously (default). lockstep: rollout, then "
        "learn, then synthesize, in turn, in this one process (the paper's schedule; a "
        "baseline)."
    ),
]
IterationsOption = Annotated[int, typer.Option(help="Learner steps of a lockstep run.", min=1)]
SynthesizeEveryOption = Annotated[
    int,
    typer.Option(
        help="Lockstep: run the data loop (signals, explore, abstract, judge) after every "
        "N learner steps; 0 disables it.",
        min=0,
    ),
]
MaxSignalsOption = Annotated[
    int, typer.Option(help="Lockstep: signals explored per synthesis, at most.", min=1)
]
MaxCrashesOption = Annotated[
    int,
    typer.Option(
        help="A service that exits this many times within --crash-window-s is held "
        "back (not restarted again); `up` and `status` say which and why.",
        min=1,
    ),
]
CrashWindowOption = Annotated[
    float, typer.Option(help="The window of --max-crashes, in seconds.", min=1.0)
]
QuietOption = Annotated[
    bool,
    typer.Option(
        "--quiet",
        help="No event lines (warm-start progress, policy versions, signals, verdicts).",
    ),
]
LabelsOption = Annotated[
    str | None,
    typer.Option(
        "--labels",
        help="Where training tasks come from: bfcl (BFCL's labelled train split) or none "
        "(only tasks discovered in the environment: D0, built first when its file is "
        "missing; BFCL's labels then reach only the held-out eval). Default: the "
        "`labels` setting (bfcl).",
        show_default=False,
    ),
]
D0Option = Annotated[
    Path | None,
    typer.Option(
        "--d0",
        help="With --labels none: the D0 file to start from (`coevolve discover` writes "
        "one). Default: the d0.file setting, d0.json in the run directory.",
        show_default=False,
    ),
]


def up(
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
    nats_port: NatsPortOption = 4222,
    nats_cluster: NatsClusterOption = 1,
    scale: ScaleOption = None,
    schedule: ScheduleOption = "async",
    iterations: IterationsOption = 100,
    synthesize_every: SynthesizeEveryOption = 1,
    max_signals: MaxSignalsOption = DEFAULT_MAX_SIGNALS,
    max_crashes: MaxCrashesOption = 5,
    crash_window_s: CrashWindowOption = 600.0,
    quiet: QuietOption = False,
    labels: LabelsOption = None,
    d0: D0Option = None,
) -> None:
    """Start the whole system on this machine and keep it running until Ctrl-C/SIGTERM.

    Starts a NATS server with JetStream (its store under RUN_DIR/nats) unless NATS_URL
    points at one, then every service as a supervised child process: a crashed service
    is restarted with back-off (reset once it is running again) and held back after
    --max-crashes exits within --crash-window-s; logs go to RUN_DIR/logs. Unless --quiet,
    prints one line per notable event: a service's phase and progress, a new policy
    version, a signal, a verdict, a task added, a dead letter, a restart, a service held
    back. Ctrl-C or SIGTERM stops everything
    within about 10 s and leaves no process behind.
    """
    settings, replicas = checked_settings(config, run_dir, scale or [], labels, d0)
    run = prepare_run_dir(settings)
    if schedule not in ("async", "lockstep"):
        raise typer.BadParameter(f"--schedule must be async or lockstep, not {schedule!r}")
    if settings.labels == "none":
        ensure_d0(settings)
    if schedule == "lockstep":
        run_lockstep_schedule(settings, iterations, synthesize_every, max_signals)
        return
    nats = start_nats(settings, nats_port, nats_cluster)
    typer.echo(f"NATS: {nats.url}   run directory: {run}")
    llm_server = start_llm_server(settings, nats)
    specs = service_specs(settings, config, replicas, nats, llm_server)
    supervise(settings, specs, nats, llm_server, Supervision(max_crashes, crash_window_s, quiet))


def checked_settings(
    config: Path | None, run_dir: Path | None, scale: list[str], labels: str | None, d0: Path | None
) -> tuple[Settings, dict[str, int]]:
    """The run's settings with ``--labels`` and ``--d0`` applied, every section a service
    will read checked, and the replicas of each service; before anything starts."""
    if labels is not None:
        if labels not in ("bfcl", "none"):
            raise typer.BadParameter(f"--labels must be bfcl or none, not {labels!r}")
        os.environ[LABELS_ENV] = labels  # the services read it too
    if d0 is not None:
        os.environ[D0_FILE_ENV] = str(d0.expanduser().resolve())
    settings = settings_from(config, run_dir)
    try:
        check_sections(settings)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    replicas = parse_scale(scale, enabled_optional_services(settings))
    if replicas.get("explorer", 0) == 0 and settings.pacing.waits:
        os.environ[PACING_ENV] = "none"  # no data loop: the learner must not wait for it
    return settings, replicas


def prepare_run_dir(settings: Settings) -> Path:
    run = settings.run_dir
    run.mkdir(parents=True, exist_ok=True)
    return run


@dataclass
class Nats:
    """The bus the services use: NATS_URL's server, or the server (or cluster) started here."""

    url: str
    bus: BusSettings
    server: NatsServer | NatsCluster | None = None

    def pids(self) -> list[int]:
        """The processes of the servers started here."""
        server = self.server
        nodes = server.nodes if isinstance(server, NatsCluster) else [server] if server else []
        return [node.process.pid for node in nodes if node.process is not None]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_nats(settings: Settings, port: int, cluster: int) -> Nats:
    """NATS_URL's server, else one started here (``cluster`` > 1: a cluster) with fresh
    credentials and the streams declared; a failed start exits."""
    nats_url = os.environ.get("NATS_URL")
    if nats_url and cluster > 1:
        raise typer.BadParameter("--nats-cluster starts its own servers: unset NATS_URL")
    if nats_url:
        return Nats(nats_url, settings.bus)
    run = settings.run_dir
    # secure by default: fresh credentials per user, the server requires them; written
    # (0600) once it started, so a refused start leaves a running run's files alone
    credentials = new_credentials()
    credentials_dir = run / NATS_CREDENTIALS_DIR
    server: NatsServer | NatsCluster
    if cluster > 1:
        server = NatsCluster(run / "nats", cluster, log_dir=run / "logs", credentials=credentials)
    else:
        server = NatsServer(
            run / "nats",
            port=port,
            log_file=run / "logs" / "nats.log",
            credentials=credentials,
        )
    try:
        server.start()
        write_credentials(credentials_dir, credentials)
        os.environ[CREDENTIALS_DIR_ENV] = str(credentials_dir)  # up's own: the reader
        bus_settings = msgspec.structs.replace(
            settings.bus,
            url=server.url,
            replicas=cluster,
            credentials=None,
            credentials_dir=str(credentials_dir),
        )
        anyio.run(declare_streams, bus_settings)
    except (NatsServerError, BusError) as exc:
        server.stop()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    return Nats(server.url, bus_settings, server)


def start_llm_server(settings: Settings, nats: Nats) -> LlamaServer | None:
    """The local LLM server, unless every LLM role names an endpoint; a failed start stops
    ``nats`` and exits."""
    try:
        return start_for_run(
            settings.services.get("llm"),
            settings.run_dir,
            lambda e: typer.echo(e),
            step_credit=step_credit_enabled(settings),
            distiller="distiller" in enabled_optional_services(settings),
        )
    except LLMServerError as exc:
        nats.stop()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def service_specs(
    settings: Settings,
    config: Path | None,
    replicas: dict[str, int],
    nats: Nats,
    llm_server: LlamaServer | None,
) -> list[ChildSpec]:
    """One child process per replica of each service: ``coevolve serve NAME``."""
    run = settings.run_dir
    base = [sys.executable, "-m", "coevolve", "serve"]
    extra = ["--run-dir", str(run)] + (["--config", str(config)] if config else [])
    return [
        ChildSpec(
            name=f"{name}-{i}" if count > 1 else name,
            argv=[*base, name, *extra],
            log_path=run / "logs" / (f"{name}-{i}.log" if count > 1 else f"{name}.log"),
            ready_file=run / "ready" / (f"{name}-{i}" if count > 1 else name),
            niceness=settings.runtime.background_niceness if name in BACKGROUND_SERVICES else 0,
            env={
                "NATS_URL": nats.url,
                REPLICAS_ENV: str(nats.bus.replicas),
                "HF_HUB_OFFLINE": "1",
                # several torch processes share the cores: one thread each avoids the
                # oversubscription that made decoding ~7x slower here
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                **(llm_server.environment() if llm_server else {}),
                **service_environment(nats.bus, name),
            },
        )
        for name, count in replicas.items()
        for i in range(count)
    ]


@dataclass(frozen=True)
class Supervision:
    """How ``up`` watches its services: the crash budget, and whether events are printed."""

    max_crashes: int
    crash_window_s: float
    quiet: bool


def supervise(
    settings: Settings,
    specs: list[ChildSpec],
    nats: Nats,
    llm_server: LlamaServer | None,
    how: Supervision,
) -> None:
    """Run the services until Ctrl-C or SIGTERM, then stop everything ``up`` started."""
    run = settings.run_dir
    printer = EventPrinter()
    watcher = None if how.quiet else EventWatcherThread(nats.url, EventTracker(printer))
    supervisor = Supervisor(
        specs,
        max_crashes=how.max_crashes,
        crash_window_s=how.crash_window_s,
        state_path=run / SUPERVISOR_FILE,
        # a service drains for drain_timeout_s, then tears down, closes its connection and
        # exits, each bounded (STOP_AFTER_DRAIN_S); a kill is for one that hangs past all that
        stop_timeout_s=settings.runtime.drain_timeout_s + STOP_MARGIN_S,
        on_event=(lambda line: typer.echo(f"[up] {line}", err=True))
        if how.quiet
        else (lambda line: printer.line("up", line)),
    )

    def request_stop(*_: object) -> None:
        supervisor.request_stop()
        if watcher is not None:
            watcher.request_stop()  # it closes its connection while the services stop

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    up_file = record_up(run, nats.url, nats.pids())
    typer.echo("services starting; `coevolve status` shows them, Ctrl-C stops everything")
    if watcher is not None:
        watcher.start()
    try:
        supervisor.run()
    finally:
        if watcher is not None:
            watcher.stop()
        if llm_server is not None:
            llm_server.stop()
        nats.stop()
        up_file.unlink(missing_ok=True)
        (run / SUPERVISOR_FILE).unlink(missing_ok=True)
        typer.echo("[up] stopped", err=True)


def run_lockstep_schedule(
    settings: Settings, iterations: int, synthesize_every: int, max_signals: int
) -> None:
    """The lockstep loop on the run's pool (seeded when empty), the data loop's LLM roles
    and service sections taken from ``settings`` as the async services take them."""
    from coevolve.cli.lockstep_cmd import run_lockstep
    from coevolve.services.pool_store.config import PoolStoreConfig
    from coevolve.services.pool_store.handler import seed_tasks_for, unlabelled_seed
    from coevolve.services.pool_store.store import PoolStore

    run = settings.run_dir
    pool_path = run / "pool.duckdb"
    with PoolStore(pool_path) as store:
        if sum(store.stats().tasks_by_origin.values()) == 0:
            pool_config = settings.section("pool_store", PoolStoreConfig)
            if settings.labels == "none":
                store.add_tasks(unlabelled_seed(settings.d0.path(run)))
            else:
                store.add_tasks(
                    seed_tasks_for("bfcl", pool_config.seed_grains, pool_config.seed_classes)
                )
    synthesis = f"synthesis every {synthesize_every}" if synthesize_every else "no synthesis"
    typer.echo(f"lockstep schedule on {pool_path}: {iterations} steps, {synthesis}")
    run_lockstep(
        run,
        pool_path,
        iterations,
        settings=settings,
        synthesize_every=synthesize_every,
        max_signals=max_signals,
    )
