"""The local llama.cpp server of a run: started only when some role in use needs it (names
no endpoint of its own), as ``coevolve up`` does before its services."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from coevolve.shared.llm.roles import parse_llm_section, role_settings
from coevolve.shared.llm.server import BASE_URL_ENV, LlamaServer, LLMServerError

# the server's own logger: where its restarts are logged, its start is too
log = logging.getLogger(LlamaServer.__module__)


def start_for_run(
    section: dict[str, object] | None,
    run_dir: Path,
    on_event: Callable[[str], None] | None = None,
    step_credit: bool = False,
    distiller: bool = False,
) -> LlamaServer | None:
    """The local server ``coevolve up`` shares among its services, started and healthy;
    None when every role in use names its own endpoint or ``COEVOLVE_LLM_BASE_URL`` is
    set. The attributor is in use only with ``step_credit`` (rollout.step_credit), the
    distiller only with the distiller service (services.distiller.enabled)."""
    if os.environ.get(BASE_URL_ENV):
        return None
    try:
        roles = role_settings(section)
    except ValueError as exc:
        raise LLMServerError(str(exc)) from exc
    optional = {"attributor": step_credit, "distiller": distiller}
    in_use = [c for role, c in roles.items() if optional.get(role, True)]
    if all(config.base_url for config in in_use):
        return None
    server = LlamaServer(
        parse_llm_section(section).server,
        log_file=run_dir / "logs" / "llm.log",
        on_event=on_event,
    )
    server.start()
    (on_event or log.info)(
        f"LLM: {server.base_url} serving {server.alias} (log: {server.log_file})"
    )
    return server
