"""Which pool tasks composition may join with a task (``AtomsFor``), on a real DuckDB."""

from __future__ import annotations

from coevolve.services.pool_store.handler import atoms_for
from coevolve.services.pool_store.store import PoolStore
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
