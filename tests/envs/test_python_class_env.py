"""A user's own environment from a plain Python class (shared/envs/python_class.py)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Literal

import pytest

import coevolve.shared.envs as envs
from coevolve.shared.envs import available_environments, make_environment, start_tasks
from coevolve.shared.envs.protocol import Environment
from coevolve.shared.envs.python_class import (
    PythonClassEnvironment,
    install_environments,
    load_class,
    register_python_environment,
    start_tasks_for,
)
from coevolve.shared.envs.rendering import compact_listing
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.toolcalls import format_tool_calls

MODULE = "tests.envs.test_python_class_env"


class Shop:
    """A tiny shop: a stock of items and a cart."""

    def __init__(self) -> None:
        self.stock: dict[str, int] = {"apple": 3, "pear": 2}
        self.cart: list[str] = []
        self._visits = 0

    def list_items(self, in_stock_only: bool = True) -> list[str]:
        """List the items the shop sells.

        Sorted by name.
        """
        return sorted(name for name, count in self.stock.items() if count or not in_stock_only)

    def add_to_cart(self, item: str, quantity: int = 1) -> dict[str, Any]:
        """Put an item in the cart, taking it from the stock."""
        left = self.stock.get(item, 0)
        if left < quantity:
            raise ValueError(f"only {left} {item} left")
        self.stock[item] = left - quantity
        self.cart.extend([item] * quantity)
        return {"cart": list(self.cart)}

    def cart_total(
        self,
        prices: dict[str, float],
        currency: Literal["EUR", "USD"] = "EUR",
        discount: float | None = None,
    ) -> str:
        """The price of the cart."""
        total = sum(prices.get(item, 0.0) for item in self.cart) - (discount or 0.0)
        return f"{total:.2f} {currency}"

    def restock(self, items: list[str], amount: int = 5) -> int:
        """Add ``amount`` of each item to the stock."""
        for item in items:
            self.stock[item] = self.stock.get(item, 0) + amount
        return len(items)

    def _reset_visits(self) -> None:
        self._visits = 0


class ScenarioShop(Shop):
    """A shop whose initial state comes through BFCL's ``_load_scenario`` convention."""

    def _load_scenario(self, scenario: dict[str, Any]) -> None:
        self.stock = dict(scenario.get("fruit", {}))


class Closed:
    def _hidden(self) -> None: ...


def call(name: str, **arguments: Any) -> str:
    return format_tool_calls([ToolCall(name=name, arguments=arguments)])


def shop_task(
    turns: list[str], truth: list[list[ToolCall]], state: dict[str, Any] | None = None
) -> Task:
    return Task(
        id="shop-1",
        environment="shop",
        user_turns=turns,
        ground_truth=truth,
        initial_state=state or {},
    )


def add(item: str, quantity: int) -> ToolCall:
    return ToolCall(name="add_to_cart", arguments={"item": item, "quantity": quantity})


@pytest.fixture
def env() -> PythonClassEnvironment:
    return PythonClassEnvironment(Shop, name="shop")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by the test are undone after it."""
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))
    monkeypatch.setattr(envs, "_STARTS", dict(envs._STARTS))


def test_the_schemas_come_from_the_signatures(env: PythonClassEnvironment) -> None:
    tools = {tool["function"]["name"]: tool for tool in env.tools()}
    assert set(tools) == {"list_items", "add_to_cart", "cart_total", "restock"}
    add_tool = tools["add_to_cart"]["function"]
    assert add_tool["description"] == "Put an item in the cart, taking it from the stock."
    assert add_tool["parameters"] == {
        "type": "object",
        "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}},
        "required": ["item"],
    }
    total = tools["cart_total"]["function"]["parameters"]
    assert total["properties"] == {
        "prices": {"type": "object", "additionalProperties": {"type": "number"}},
        "currency": {"type": "string", "enum": ["EUR", "USD"]},
        "discount": {"type": ["number", "null"]},
    }
    assert total["required"] == ["prices"]
    assert tools["restock"]["function"]["parameters"]["properties"]["items"] == {
        "type": "array",
        "items": {"type": "string"},
    }
    assert tools["list_items"]["function"]["description"] == "List the items the shop sells."
    assert isinstance(env, Environment)


def test_the_compact_rendering_groups_the_tools_under_the_class(
    env: PythonClassEnvironment,
) -> None:
    listing = compact_listing(env.tools()).splitlines()
    assert listing[0] == "# Shop"
    add_line = "add_to_cart(item: str, quantity?: int) - Put an item in the cart, taking it"
    assert f"{add_line} from the stock." in listing
    assert (
        "restock(items: list[str], amount?: int) - Add ``amount`` of each item to the stock."
        in listing
    )


def test_reset_loads_the_initial_state_and_returns_the_first_turn(
    env: PythonClassEnvironment,
) -> None:
    messages = env.reset(shop_task(["Hi", "Bye"], [[], []], {"stock": {"kiwi": 4}}))
    assert [(m.role, m.content) for m in messages] == [("user", "Hi")]
    assert env.state() == {"stock": {"kiwi": 4}, "cart": []}
    with pytest.raises(ValueError, match=r"no public attribute\(s\) \['_visits', 'colour'\]"):
        env.reset(shop_task(["Hi"], [[]], {"_visits": 3, "colour": "red"}))
    with pytest.raises(ValueError, match="is for 'other'"):
        env.reset(Task(id="t", environment="other", user_turns=["Hi"]))


def test_reset_uses_load_scenario_when_the_class_has_one() -> None:
    env = PythonClassEnvironment(ScenarioShop, name="shop")
    env.reset(shop_task(["Hi"], [[]], {"fruit": {"fig": 1}}))
    assert env.state()["stock"] == {"fig": 1}


def test_episodes_share_no_state() -> None:
    first, second = (
        PythonClassEnvironment(Shop, name="shop"),
        PythonClassEnvironment(Shop, name="shop"),
    )
    state = {"stock": {"apple": 1}}
    first.reset(shop_task(["Add an apple."], [[add("apple", 1)]], state))
    second.reset(shop_task(["Add an apple."], [[add("apple", 1)]], state))
    assert first.execute(add("apple", 1)) == (True, '{"cart": ["apple"]}')
    assert second.state()["stock"] == {"apple": 1}
    assert state == {"stock": {"apple": 1}}


def test_a_correct_call_scores_one(env: PythonClassEnvironment) -> None:
    env.reset(shop_task(["Put two apples in my cart."], [[add("apple", 2)]]))
    result = env.step(call("add_to_cart", item="apple", quantity=2))
    assert not result.done
    assert result.observations[0].content == '{"cart": ["apple", "apple"]}'
    assert result.info["calls"] == ["add_to_cart"]
    assert result.info["call_strings"] == ["add_to_cart(item='apple', quantity=2)"]
    end = env.step("Done.")
    assert end.done and end.info["turn_ended"] and end.info["end_reason"] == "all turns answered"
    assert env.score() == 1.0
    assert env.partial_credit() == 1.0


def test_a_wrong_call_scores_zero(env: PythonClassEnvironment) -> None:
    env.reset(shop_task(["Put two apples in my cart."], [[add("apple", 2)]]))
    env.step(call("add_to_cart", item="apple"))
    env.step("Done.")
    assert env.score() == 0.0
    assert env.last_report is not None and "state differs" in env.last_report.message
    assert env.partial_credit() == 0.0


def test_defaults_count_as_given_in_partial_credit(env: PythonClassEnvironment) -> None:
    truth = [[add("apple", 1), add("pear", 1)]]
    env.reset(shop_task(["An apple and a pear."], truth))
    env.step(call("add_to_cart", item="apple"))  # quantity 1 by default
    env.step("Done.")
    assert env.score() == 0.0  # the pear is missing
    assert env.partial_credit() == 0.5


def test_a_turn_must_return_the_ground_truths_results(env: PythonClassEnvironment) -> None:
    """Same state, other result: the response check fails."""
    truth = [[add("apple", 1)], [ToolCall(name="cart_total", arguments={"prices": {"apple": 2}})]]
    env.reset(shop_task(["Add an apple.", "What do I owe?"], truth))
    env.step(call("add_to_cart", item="apple", quantity=1))
    next_turn = env.step("Added.")
    assert [(m.role, m.content) for m in next_turn.observations] == [("user", "What do I owe?")]
    assert not next_turn.done and next_turn.info["turn"] == 1
    env.step(call("cart_total", prices={"apple": 3.0}))
    env.step("3.00 EUR")
    assert env.score() == 0.0
    assert env.last_report is not None and "cart_total" in env.last_report.message
    env.reset(shop_task(["Add an apple.", "What do I owe?"], truth))
    env.replay(truth)
    assert env.score() == 1.0


def test_an_unfinished_episode_scores_zero() -> None:
    env = PythonClassEnvironment(Shop, name="shop", max_steps_per_turn=1)
    env.reset(shop_task(["Add an apple."], [[add("apple", 1)]]))
    env.step(call("add_to_cart", item="apple", quantity=1))
    result = env.step(call("list_items"))
    assert result.done and "step budget" in result.info["end_reason"]
    assert env.score() == 0.0


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (call("checkout"), "unknown function 'checkout'"),
        (call("_reset_visits"), "unknown function '_reset_visits'"),
        (call("add_to_cart", quantity=1), "missing required argument(s): item"),
        (call("add_to_cart", item="apple", colour="red"), "unknown argument(s) ['colour']"),
        (call("add_to_cart", item="apple", quantity="2"), "'quantity' must be integer, got string"),
        (call("add_to_cart", item="apple", quantity=True), "must be integer, got boolean"),
        (call("restock", items=["fig", 3]), "argument 'items'[1] must be string, got integer"),
        (call("cart_total", prices={}, currency="GBP"), "must be one of ['EUR', 'USD']"),
        ("<tool_call>{not json</tool_call>", "not valid JSON"),
    ],
)
def test_bad_calls_come_back_as_error_observations(
    env: PythonClassEnvironment, text: str, error: str
) -> None:
    env.reset(shop_task(["Shop."], [[]]))
    before = env.state()
    result = env.step(text)
    assert not result.done
    [observation] = result.observations
    assert observation.role == "tool"
    assert observation.content.startswith("Error") and error in observation.content
    assert result.info["errors"] == [observation.content]
    assert result.info["calls"] == []
    assert env.state() == before


def test_an_exception_in_a_method_is_an_error_observation(env: PythonClassEnvironment) -> None:
    env.reset(shop_task(["Shop."], [[]]))
    result = env.step(call("add_to_cart", item="apple", quantity=9))
    assert [m.content for m in result.observations] == ["Error: ValueError: only 3 apple left"]
    assert result.info["errors"] == ["Error: ValueError: only 3 apple left"]
    assert result.info["calls"] == ["add_to_cart"]  # it ran, and failed
    assert env.state()["stock"]["apple"] == 3


def test_execute_and_nullable_arguments(env: PythonClassEnvironment) -> None:
    env.reset(shop_task(["Shop."], [[]]))
    assert env.execute(add("pear", 2))[0]
    ok, text = env.execute(
        ToolCall(name="cart_total", arguments={"prices": {"pear": 1.5}, "discount": None})
    )
    assert (ok, text) == (True, '"3.00 EUR"')
    assert env.execute(ToolCall(name="nope"))[0] is False


def test_replay_runs_the_turns_and_reports_errors(env: PythonClassEnvironment) -> None:
    truth = [[add("apple", 2)], [ToolCall(name="restock", arguments={"items": ["apple"]})]]
    env.reset(shop_task(["Two apples.", "Restock apples."], truth))
    replayed = env.replay(truth)
    assert replayed.ok and replayed.state_changed
    assert replayed.observations == ['{"cart": ["apple", "apple"]}', "1"]
    assert env.state()["stock"]["apple"] == 6
    assert env.score() == 1.0
    env.reset(shop_task(["Too many."], [[add("apple", 7)]]))
    failed = env.replay([[add("apple", 7)], [add("pear", 1)]])
    assert not failed.ok and not failed.state_changed
    assert "only 3 apple left" in failed.errors[0]
    assert "no more turns" in failed.errors[1]


def test_start_tasks_explore_from_an_initial_state(env: PythonClassEnvironment) -> None:
    tasks = start_tasks_for("shop", Shop, [{"stock": {"fig": 1}}, {}])
    assert [t.id for t in tasks] == ["shop-state-0", "shop-state-1"]
    assert all(
        t.environment == "shop" and t.user_turns == [] and t.ground_truth == [] for t in tasks
    )
    assert all(t.origin == "seed" and t.env_config == {"grain": "turn"} for t in tasks)
    assert [t.initial_state for t in tasks] == [{"stock": {"fig": 1}}, {}]
    assert [t.id for t in start_tasks_for("shop", Shop)] == ["shop-state-0"]
    assert env.reset(tasks[0]) == []
    ran = env.step(call("add_to_cart", item="fig"))
    assert not ran.done and env.state()["cart"] == ["fig"]
    assert env.step("That is all.").done
    assert env.score() == 0.0


NOTES_SOURCE = '''
from __future__ import annotations

from typing import Optional


class Notes:
    """Notes by title."""

    def __init__(self) -> None:
        self.notes: dict[str, str] = {}

    def write(self, title: str, text: str) -> str:
        """Write a note.

        Replaces a note of the same title.
        """
        self.notes[title] = text
        return title

    def read(self, title: str, default: Optional[str] = None) -> Optional[str]:
        """Read a note."""
        return self.notes.get(title, default)
'''


def test_load_class_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "notes_env.py"
    path.write_text(textwrap.dedent(NOTES_SOURCE))
    cls = load_class(f"{path}:Notes")
    env = PythonClassEnvironment(cls, name="notes")
    schemas = {t["function"]["name"]: t["function"] for t in env.tools()}
    assert schemas["write"]["description"] == "Write a note."
    assert schemas["read"]["parameters"]["properties"]["default"] == {"type": ["string", "null"]}
    env.reset(
        Task(
            id="n",
            environment="notes",
            user_turns=["Note it."],
            initial_state={"notes": {"a": "b"}},
        )
    )
    assert env.execute(ToolCall(name="read", arguments={"title": "a"})) == (True, '"b"')


def test_load_class_from_a_module() -> None:
    assert load_class(f"{MODULE}:Shop") is Shop


def test_load_class_from_a_package_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "my_notes_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "notes_env.py").write_text(textwrap.dedent(NOTES_SOURCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_class("my_notes_pkg.notes_env:Notes").__name__ == "Notes"
    with pytest.raises(ValueError, match=re.escape("or name its file: 'no_such_pkg/shop.py:Shop'")):
        load_class("no_such_pkg.shop:Shop")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("Shop", "is not 'package.module:ClassName'"),
        (f"{MODULE}:", "is not 'package.module:ClassName'"),
        ("no_such_package.shop:Shop", "cannot import 'no_such_package.shop'"),
        (f"{MODULE}:Missing", "has no class 'Missing'"),
        (f"{MODULE}:MODULE", "has no class 'MODULE'"),
        (f"{MODULE}:Closed", "no public method"),
        ("/no/such/dir/shop.py:Shop", "no file"),
    ],
)
def test_load_class_refuses_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        load_class(spec)
    assert message in str(caught.value)


def test_load_class_reports_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("class Broken(\n")
    with pytest.raises(ValueError, match=r"loading .*broken\.py failed: SyntaxError"):
        load_class(f"{path}:Broken")


@pytest.mark.usefixtures("registry")
def test_install_environments_registers_a_class() -> None:
    install_environments(
        {"shop_test": {"class": f"{MODULE}:Shop", "initial_states": [{"stock": {"kiwi": 2}}]}}
    )
    assert "shop_test" in available_environments()
    env = make_environment("shop_test", max_steps=5)
    assert isinstance(env, PythonClassEnvironment)
    assert env.name == "shop_test" and env.max_steps == 5
    [start] = start_tasks("shop_test")
    assert (start.id, start.initial_state) == ("shop_test-state-0", {"stock": {"kiwi": 2}})
    task = Task(
        id="t",
        environment="shop_test",
        user_turns=["A kiwi."],
        initial_state=start.initial_state,
        ground_truth=[[add("kiwi", 1)]],
    )
    env.reset(task)
    env.step(call("add_to_cart", item="kiwi"))
    env.step("Done.")
    assert env.score() == 1.0
    register_python_environment("shop_plain", f"{MODULE}:Shop")
    assert [t.initial_state for t in start_tasks("shop_plain")] == [{}]


@pytest.mark.usefixtures("registry")
@pytest.mark.parametrize(
    ("section", "messages"),
    [
        ({"shop": {"initial_states": []}}, ["environments.shop: 'class' must be"]),
        (
            {"shop": {"class": f"{MODULE}:Shop", "states": []}},
            ["environments.shop: unknown key(s) ['states']"],
        ),
        (
            {"shop": {"class": f"{MODULE}:Shop", "initial_states": {"stock": {}}}},
            ["environments.shop: 'initial_states' must be a list of mappings"],
        ),
        (
            {"shop": {"class": f"{MODULE}:Shop", "initial_states": ["stock"]}},
            ["environments.shop: 'initial_states' must be a list of mappings"],
        ),
        ({"shop": f"{MODULE}:Shop"}, ["environments.shop: must be a mapping"]),
        ({"shop": {"class": f"{MODULE}:Nope"}}, ["environments.shop: ", "has no class 'Nope'"]),
        (
            {"shop": {"class": f"{MODULE}:Shop", "initial_states": [{}, {"colour": "red"}]}},
            ["environments.shop: initial_states[1]: ", "['colour']"],
        ),
        ({"bfcl": {"class": f"{MODULE}:Shop"}}, ["environments.bfcl: the name 'bfcl'"]),
        (
            {"my shop": {"class": f"{MODULE}:Shop"}},
            ["environments.my shop: 'my shop' is not an environment name"],
        ),
    ],
)
def test_bad_configuration_is_refused_with_its_place(
    section: dict[str, Any], messages: list[str]
) -> None:
    before = available_environments()
    with pytest.raises(ValueError) as caught:
        install_environments(section)
    assert all(message in str(caught.value) for message in messages), str(caught.value)
    assert available_environments() == before
