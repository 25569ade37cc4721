"""The example environment that ships with the project (``examples/shop``): its
configuration loads as a user runs it, from its own folder; a request's calls replay and
score in it; and (slow) ``coevolve up --labels none`` trains on it from a fresh run
directory, its services as child processes on a real NATS with the local models."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

import coevolve.shared.envs as envs
from coevolve.harness import UpRun, policy_version
from coevolve.services.evaluator.config import EvaluatorConfig, heldout_every
from coevolve.services.evaluator.handler import own_held_out
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import load_settings
from coevolve.shared.envs import make_environment, start_tasks
from coevolve.shared.messages import ToolCall
from coevolve.shared.task_sets import load_d0
from coevolve.shared.toolcalls import format_tool_calls

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "shop"
TOOLS = {"list_items", "price_of", "add_to_cart", "remove_from_cart", "checkout"}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environments registered by a test stay in that test."""
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))
    monkeypatch.setattr(envs, "_STARTS", dict(envs._STARTS))


def test_the_example_configuration_loads_from_its_folder(
    registry: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(EXAMPLE)
    settings = load_settings(Path("coevolve.yaml"), run_dir=str(tmp_path / "run"))
    assert settings.labels == "none" and settings.d0.environment == "shop"
    starts = start_tasks("shop")
    assert len(starts) == 3 and all(s.user_turns == [] and s.ground_truth == [] for s in starts)
    environment = make_environment("shop")
    environment.reset(starts[0])
    assert {tool["function"]["name"] for tool in environment.tools()} == TOOLS


def test_the_example_held_out_tasks_replay_in_the_shop(
    registry: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(EXAMPLE)
    settings = load_settings(Path("coevolve.yaml"), run_dir=str(tmp_path / "run"))
    own = own_held_out(settings.section("evaluator", EvaluatorConfig), settings)
    assert own is not None and own.environment == "shop" and len(own.tasks) == 6
    assert own.source == f"file {EXAMPLE / 'heldout.json'}"
    for task in own.tasks:
        environment = make_environment("shop")
        environment.reset(task)
        assert environment.replay(task.ground_truth).ok, task.id
    assert heldout_every(settings) == 0  # the user's file: D0 keeps none of its own


def test_a_request_replays_and_scores_in_the_example_shop(
    registry: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(EXAMPLE)
    load_settings(Path("coevolve.yaml"), run_dir=str(tmp_path / "run"))
    calls = [
        ToolCall(name="add_to_cart", arguments={"item": "apple", "quantity": 2}),
        ToolCall(name="checkout", arguments={}),
    ]
    task = msgspec.structs.replace(
        start_tasks("shop")[0],
        id="shop-example",
        user_turns=["Put two apples in my cart and pay for them."],
        ground_truth=[calls],
    )
    environment = make_environment("shop")
    environment.reset(task)
    assert environment.replay(task.ground_truth).ok
    environment.reset(task)
    environment.step(format_tool_calls(calls))
    environment.step("Done: order 1, 1.0 in all.")
    assert environment.score() == 1.0
    environment.reset(task)
    environment.step(format_tool_calls(calls[:1]))
    environment.step("Your apples are in the cart.")
    assert environment.score() == 0.0  # not paid: the state differs


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_up_with_no_labels_trains_on_the_example_shop(tmp_path: Path) -> None:
    config = yaml.safe_load((EXAMPLE / "coevolve.yaml").read_text())
    config["environments"]["shop"]["class"] = f"{EXAMPLE / 'shop.py'}:Shop"
    config["services"]["evaluator"]["heldout_file"] = str(EXAMPLE / "heldout.json")
    config["d0"].update(first_tasks=1, max_minutes=25)
    path = tmp_path / "coevolve.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    log = tmp_path / "up.log"
    with UpRun.start(run_dir, log, config=path) as up:
        ended = up.wait(policy_version(1), seconds=35 * 60)
        up.expect(ended, "condition", "policy v1 (the warm start on D0)")
        # rollout groups on the discovered tasks; a trained step when one had a gradient
        up.wait(policy_version(2), seconds=up.elapsed_s() + 8 * 60)
    text = log.read_text()
    assert "[d0] budget: 1 tasks" in text and "then training starts" in text
    d0 = load_d0(run_dir / "d0.json")
    assert d0.environment == "shop" and d0.tasks
    assert {call.name for task in d0.tasks for turn in task.ground_truth for call in turn} <= TOOLS
    with PoolStore.open_readonly(run_dir / "pool.duckdb") as store:
        stats = store.stats()
    assert stats.tasks_by_origin.get("explored", 0) >= len(d0.tasks) and stats.results > 0
