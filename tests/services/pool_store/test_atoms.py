"""Which pool tasks composition may join with a task (``AtomsFor``), on a real DuckDB."""

from __future__ import annotations

import msgspec

from coevolve.services.pool_store.handler import atoms_for, tasks_calling
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Lineage, TasksCalling, ToolCall
from tests.services.pool_store.conftest import TaskFactory

TRADING = {"category": "multi_turn_base", "involved_classes": ["TradingBot"], "grain": "turn"}


def test_atoms_share_the_setting_and_carry_no_conversation(
    store: PoolStore, make_task: TaskFactory
) -> None:
    failed = make_task(env_config={**TRADING, "turn": 0, "prior_turns": []})
    other_state = make_task(env_config=TRADING, initial_state={"TradingBot": {"balance": 5}})
    later_turn = make_task(
        env_config={**TRADING, "turn": 2, "prior_turns": ["a", "b"], "prior_ground_truth": []}
    )
    vehicle = make_task(env_config={**TRADING, "involved_classes": ["VehicleControlAPI"]})
    retired = make_task(env_config=TRADING)
    store.add_tasks([failed, other_state, later_turn, vehicle, retired])
    store.set_status([retired.id], "retired")

    atoms = [task.id for task in atoms_for(store, failed.id, limit=20)]

    # another state of the same classes may join (its calls are run from the failed turn's
    # state); a turn that follows a conversation, other classes, a retired task may not
    assert atoms == [other_state.id]
    assert atoms_for(store, "no-such-task", limit=20) == []


def test_tasks_calling_are_unsynthesized_active_and_call_a_named_function(
    store: PoolStore, make_task: TaskFactory
) -> None:
    def calling(*names: str) -> list[list[ToolCall]]:
        return [[ToolCall(name=name) for name in names]]

    failed = make_task(ground_truth=calling("get_stock_info"))
    sibling = make_task(ground_truth=calling("get_watchlist", "get_stock_info"))
    other_function = make_task(ground_truth=calling("place_order"))
    child = make_task(ground_truth=calling("get_stock_info"), lineage=Lineage(depth=1))
    retired = make_task(ground_truth=calling("get_stock_info"))
    elsewhere = make_task(ground_truth=calling("get_stock_info"), environment="notebook")
    store.add_tasks([failed, sibling, other_function, child, retired, elsewhere])
    store.set_status([retired.id], "retired")

    request = TasksCalling(functions=["get_stock_info"], environment="bfcl", exclude=[failed.id])
    assert [task.id for task in tasks_calling(store, request)] == [sibling.id]
    both = msgspec.structs.replace(request, functions=["get_stock_info", "place_order"], limit=1)
    assert len(tasks_calling(store, both)) == 1
