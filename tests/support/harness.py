"""Stand-ins for ``coevolve up`` under the harness: a real child process group that writes
what ``up`` would, without a model or a NATS server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from coevolve.harness import UpRun

# records a NATS URL as up does once its server listens, then idles until stopped
IDLE_UP = """
import json, pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
run = pathlib.Path(sys.argv[1])
run.mkdir(parents=True, exist_ok=True)
(run / "up.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:4999"}))
time.sleep(120)
"""


def standin_up(run_dir: Path, log_path: Path, code: str = IDLE_UP, **options: Any) -> UpRun:
    """:meth:`UpRun.start` with ``python -c CODE RUN_DIR`` in place of ``coevolve up``; the
    base run (whose models would be linked in) is ``RUN_DIR/../base`` unless ``base`` is
    given."""
    argv = [sys.executable, "-c", code, str(run_dir)]
    options.setdefault("base", run_dir.parent / "base")
    return UpRun.start(run_dir, log_path, argv=argv, **options)
