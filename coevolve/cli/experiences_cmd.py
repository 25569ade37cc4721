"""``coevolve experiences``: what the distiller has drawn from rollouts (self-navigating),
read from pool-store while it runs or from the run's DuckDB file after."""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
import typer

from coevolve.cli.data_cmds import JsonLines, connect_settings, run_on_pool_or_file
from coevolve.cli.options import ConfigOption, RunDirOption
from coevolve.services.pool_store.handler import experiences_reply
from coevolve.shared.messages import Experience, ExperiencesReply
from coevolve.shared.pool_client import PoolClient

experiences_app = typer.Typer(
    name="experiences",
    help=(
        "Inspect the experiences the distiller drew from rollout groups for navigated "
        "rollouts (services.distiller.enabled): list them, show one."
    ),
    no_args_is_help=True,
    add_completion=False,
)

ALL = 10_000


def _kept(config: Any, run_dir: Any, limit: int) -> ExperiencesReply:
    settings = connect_settings(config, run_dir)

    async def via_pool(pool: PoolClient) -> ExperiencesReply:
        return await pool.experiences(limit)

    reply: ExperiencesReply = run_on_pool_or_file(
        settings, via_pool, lambda store: experiences_reply(store, limit)
    )
    return reply


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@experiences_app.command("list")
def list_experiences(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=ALL)] = 20,
    json_output: JsonLines = False,
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """The newest experiences: id, the task they came from, how many rollout jobs carried
    them, and the advice."""
    reply = _kept(config, run_dir, limit)
    if json_output:
        typer.echo(json.dumps(msgspec.to_builtins(reply)))
        return
    typer.echo(f"{reply.total} experiences kept; the newest {len(reply.experiences)}:")
    typer.echo(f"{'id':<34}{'task':<34}{'used':>5}  advice")
    for experience in reply.experiences:
        uses = reply.uses.get(experience.id, 0)
        typer.echo(
            f"{experience.id:<34}{experience.task_id:<34}{uses:>5}  "
            f"{_one_line(experience.text, 90)}"
        )


@experiences_app.command("show")
def show_experience(
    experience_id: Annotated[str, typer.Argument(help="Experience id (a unique prefix will do).")],
    json_output: JsonLines = False,
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """One experience: its advice, the task and request it came from, the two attempts it
    compares (its lineage) and how often rollout jobs carried it."""
    reply = _kept(config, run_dir, ALL)
    found = [e for e in reply.experiences if e.id.startswith(experience_id)]
    if len(found) != 1:
        what = "no experience" if not found else f"{len(found)} experiences"
        typer.echo(f"error: {what} with id {experience_id!r}", err=True)
        raise typer.Exit(1)
    experience: Experience = found[0]
    uses = reply.uses.get(experience.id, 0)
    if json_output:
        typer.echo(json.dumps({**msgspec.to_builtins(experience), "uses": uses}))
        return
    typer.echo(f"experience {experience.id}  (policy v{experience.policy_version})")
    typer.echo(f"advice: {experience.text}")
    typer.echo(f"task: {experience.task_id} ({experience.environment})")
    typer.echo(f"request: {_one_line(experience.request, 300)}")
    if experience.functions:
        typer.echo(f"functions called: {', '.join(experience.functions)}")
    pairs = zip(experience.trajectory_ids, experience.rewards, strict=False)
    attempts = ", ".join(f"{t} (reward {r:.2f})" for t, r in pairs)
    typer.echo(f"from group {experience.group_id}: better and worse attempts {attempts}")
    typer.echo(f"carried by {uses} rollout jobs")
