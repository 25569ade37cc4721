"""``coevolve explore``: ask the running explorers for unguided exploration (seed mode).

The paper's seed mode, and the random-exploration baseline of its ablation: the explorer
starts from a train-split task's state with no failure signal and explores freely; what it
finds goes through the abstractor and the judge like any other exploration. Useful when
the policy is still too weak to fail in interesting ways (a base model that never calls a
tool raises no boundary or rare signals).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Annotated

import anyio
import typer

from coevolve.cli.data_cmds import connect_settings
from coevolve.cli.options import ConfigOption, RunDirOption
from coevolve.exploration import publish_requests
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.shared.envs.bfcl.tasks import in_world, seed_tasks, state_tasks
from coevolve.shared.messages import ExplorationRequest, Task
from coevolve.shared.runtime.bus import Bus, BusError
from coevolve.shared.runtime.permissions import OPERATOR
from coevolve.shared.runtime.subjects import EXPLORATION_REQUESTS


def choose_tasks(
    count: int,
    seed: int,
    task_ids: list[str] | None = None,
    classes: Sequence[str] | None = None,
    labelled: bool = True,
) -> list[Task]:
    """``task_ids`` from the train split, or ``count`` of its tasks drawn with ``seed``;
    only entries of the world ``classes`` (None: every entry). Not ``labelled`` (a run
    with no labels): the train split's initial states alone, with no question or answer."""
    candidates = seed_tasks() if labelled else state_tasks()
    train = [task for task in candidates if in_world(task, classes)]
    if task_ids:
        by_id = {task.id: task for task in train}
        unknown = [task_id for task_id in task_ids if task_id not in by_id]
        if unknown:
            raise typer.BadParameter(
                f"not in the train split of the run's world: {', '.join(unknown)} (eval "
                "entries are never explored)",
                param_hint="--task",
            )
        return [by_id[task_id] for task_id in task_ids]
    if count > len(train):
        raise typer.BadParameter(f"the train split has {len(train)} tasks", param_hint="--tasks")
    return random.Random(seed).sample(train, count)


def explore(
    tasks: Annotated[
        int, typer.Option("--tasks", "-n", min=1, help="Train-split tasks to explore from.")
    ] = 1,
    task_ids: Annotated[
        list[str] | None,
        typer.Option("--task", help="A train-split task id to explore from (repeatable)."),
    ] = None,
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds", min=1, help="Exploration rounds per task (capped by the explorer)."
        ),
    ] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the task draw.")] = 0,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the requests as one JSON object.")
    ] = False,
    config: ConfigOption = None,
    run_dir: RunDirOption = None,
) -> None:
    """Publish unguided exploration requests from train-split states (seed mode); in a
    run with no labels (`labels: none`), from the states alone, with no question."""
    settings = connect_settings(config, run_dir)
    world = settings.section("pool_store", PoolStoreConfig).seed_classes
    chosen = choose_tasks(tasks, seed, task_ids, world, labelled=settings.labels != "none")

    async def main() -> list[ExplorationRequest]:
        bus = await Bus.connect(settings.bus, name="coevolve-explore", user=OPERATOR)
        try:
            await bus.ensure_streams()
            return await publish_requests(bus, chosen, rounds)
        finally:
            await bus.close()

    try:
        requests = anyio.run(main)
    except (BusError, OSError, TimeoutError) as exc:
        typer.echo(f"error: cannot reach NATS at {settings.bus.url}: {exc}", err=True)
        raise typer.Exit(1) from exc
    if json_output:
        listing = [{"id": r.id, "task_id": r.task.id, "rounds": r.rounds} for r in requests]
        typer.echo(json.dumps({"subject": EXPLORATION_REQUESTS, "requests": listing}))
        return
    for request in requests:
        typer.echo(f"requested {request.id}: task {request.task.id}, {request.rounds} round(s)")
