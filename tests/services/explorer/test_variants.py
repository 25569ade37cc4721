"""The other values a variant round may pass, read from a real BFCL state."""

from __future__ import annotations

from typing import Any

from coevolve.services.explorer.variants import alternatives, varied_tools
from coevolve.shared.envs import make_environment, state_of
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import ToolCall


def state_with(cls: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    task = next(t for t in seed_tasks() if cls in t.env_config.get("involved_classes", []))
    environment = make_environment("bfcl")
    try:
        environment.reset(task)
        state = state_of(environment)
        assert state is not None
        return state, environment.tools()
    finally:
        environment.close()


def test_a_key_of_a_mapping_varies_over_its_other_keys() -> None:
    state, _ = state_with("TradingBot")
    others = alternatives(state, "NVDA", ["NVDA"])
    assert "NVDA" not in others and {"AAPL", "GOOG"} <= set(others)


def test_a_value_of_a_flat_mapping_varies_over_its_other_values() -> None:
    state, _ = state_with("MessageAPI")
    user_map = next(v["user_map"] for v in state.values() if "user_map" in v)
    first, *rest = list(user_map.values())
    assert set(alternatives(state, first, [first])) >= set(rest)


def test_a_field_of_a_record_varies_over_the_same_field_of_its_siblings() -> None:
    state = {"orders": {"1": {"symbol": "AAPL", "n": 3}, "2": {"symbol": "TSLA", "n": 5}}}
    assert alternatives(state, "AAPL", ["AAPL"]) == ["TSLA"]


def test_a_value_the_state_does_not_hold_has_no_alternatives() -> None:
    state, _ = state_with("TradingBot")
    assert alternatives(state, "ZZZZ", ["ZZZZ"]) == []
    assert alternatives(None, "NVDA", ["NVDA"]) == []


def test_only_the_tried_functions_parameter_is_restricted() -> None:
    state, tools = state_with("TradingBot")
    tried = [ToolCall(name="get_stock_info", arguments={"symbol": "NVDA"})]
    varied = {t["function"]["name"]: t for t in varied_tools(tools, tried, state)}
    originals = {t["function"]["name"]: t for t in tools}
    symbol = varied["get_stock_info"]["function"]["parameters"]["properties"]["symbol"]
    assert "NVDA" not in symbol["enum"] and "AAPL" in symbol["enum"]
    assert (
        "enum" not in originals["get_stock_info"]["function"]["parameters"]["properties"]["symbol"]
    )
    assert varied["place_order"] == originals["place_order"]
