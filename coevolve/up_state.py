"""What a running ``coevolve up`` records in its run directory for other processes: the
NATS URL its services use (``up.json``) and its supervisor's view of every service
(``supervisor.json``). ``up`` writes them; ``status``, the data commands, the process
helpers of the experiments and the benchmarks read them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from coevolve.shared.runtime.supervisor import read_state

UP_FILE = "up.json"
# the supervisor's view of every service (state, exits, held back and why): `status` reads it
SUPERVISOR_FILE = "supervisor.json"


def record_up(run_dir: Path, nats_url: str, nats_pids: list[int]) -> Path:
    """Write ``up.json`` for this process, a ``coevolve up`` on ``run_dir``; returns it."""
    path = run_dir / UP_FILE
    path.write_text(
        json.dumps(
            {
                "nats_url": nats_url,
                "nats_pid": nats_pids[0] if nats_pids else None,
                "nats_pids": nats_pids,
                "pid": os.getpid(),
                "at": time.time(),
            }
        )
    )
    return path


def recorded_nats_url(run_dir: Path) -> str | None:
    """The NATS URL of a `coevolve up` running on ``run_dir``, if any."""
    try:
        url = json.loads((run_dir / UP_FILE).read_text())["nats_url"]
    except (OSError, ValueError, KeyError):
        return None
    return str(url)


def supervised_services(run_dir: Path) -> dict[str, dict[str, object]]:
    """The supervisor's state of each service of a `coevolve up` on ``run_dir`` (empty
    when none runs there)."""
    state = read_state(run_dir / SUPERVISOR_FILE)
    children = state.get("children") if state else None
    return dict(children) if isinstance(children, dict) else {}
