"""``coevolve serve NAME``: run one service in this process (what compose runs)."""

from __future__ import annotations

import importlib
import os
from typing import Annotated

import typer

from coevolve.cli.options import ConfigOption, RunDirOption, settings_from
from coevolve.shared.config import Settings
from coevolve.shared.runtime.actor import Actor, run_actor
from coevolve.shared.runtime.subjects import SERVICES


def build_actor(name: str, settings: Settings) -> Actor:
    if name not in SERVICES:
        raise typer.BadParameter(f"unknown service {name!r}; choose one of {', '.join(SERVICES)}")
    module = importlib.import_module(f"coevolve.services.{name}.actor")
    actor: Actor = module.build(settings)
    return actor


def serve(
    name: Annotated[str, typer.Argument(help=f"Service to run: {', '.join(SERVICES)}.")],
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """Run one service until SIGTERM or Ctrl-C (graceful drain, exit 0).

    Connects to NATS_URL (default nats://127.0.0.1:4222); replicas of the same service
    share its work queue, so start as many as you like.
    """
    name = name.replace("-", "_")
    settings = settings_from(config, run_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_actor(build_actor(name, settings))
