"""The abstractor's novelty check against the pool's user turns (real BFCL seed turns)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from coevolve.services.abstractor.actor import PoolQueries, query_texts
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import Task, ToolCall
from tests.dataloop.dataloop_harness import filesystem_seed_tasks


def pool_queries(tmp_path: Path) -> PoolQueries:
    queries = PoolQueries(0.7, "ngram", tmp_path)
    queries.replace_pool([text for task in seed_tasks() for text in query_texts(task)])
    return queries


def with_turns(task: Task, turns: list[str]) -> Task:
    return msgspec.structs.replace(task, id="candidate", user_turns=turns)


def test_a_copy_or_light_edit_of_a_pool_task_is_a_duplicate(tmp_path: Path) -> None:
    queries = pool_queries(tmp_path)
    seed = filesystem_seed_tasks(1)[0]
    assert queries.duplicate_of(seed) is not None
    edited = [
        turn.replace("Could you", "Can you").rstrip(".?") + ", please." for turn in seed.user_turns
    ]
    found = queries.duplicate_of(with_turns(seed, edited))
    assert found is not None and found[0] >= 0.7


def test_a_new_request_is_not_a_duplicate_even_next_to_copied_turns(tmp_path: Path) -> None:
    queries = pool_queries(tmp_path)
    seed = filesystem_seed_tasks(1)[0]
    new = "Create a directory called quarterly_budget_review and list what it contains afterwards."
    assert queries.duplicate_of(with_turns(seed, [new])) is None
    # one copied turn is not enough when another turn asks something new
    assert queries.duplicate_of(with_turns(seed, [seed.user_turns[0], new])) is None


def test_recent_candidates_count_until_they_reach_the_pool(tmp_path: Path) -> None:
    queries = pool_queries(tmp_path)
    seed = filesystem_seed_tasks(1)[0]
    new = "Create a directory called quarterly_budget_review and list what it contains afterwards."
    candidate = with_turns(seed, [new])
    queries.add(query_texts(candidate))
    assert queries.duplicate_of(candidate) is not None
    queries.replace_pool(["Something else entirely, about tickets and their priorities today."])
    assert queries.duplicate_of(candidate) is not None  # still remembered after a refresh


def test_short_turns_alone_are_compared_joined() -> None:
    task = Task(id="t", environment="bfcl", user_turns=["Yes.", "Do it now."])
    assert query_texts(task) == ["Yes.\nDo it now."]


def test_a_near_copy_naming_other_values_is_a_variant_not_a_duplicate(tmp_path: Path) -> None:
    queries = PoolQueries(0.7, "ngram", tmp_path)
    request = "Get the price, volume and moving averages for the stock with symbol {}, please."
    queries.replace_pool([request.format("AAPL")])
    seed = next(t for t in seed_tasks() if "TradingBot" in t.env_config["involved_classes"])

    def candidate(symbol: str) -> Task:
        call = ToolCall(name="get_stock_info", arguments={"symbol": symbol})
        return msgspec.structs.replace(
            seed, id="c", user_turns=[request.format(symbol)], ground_truth=[[call]]
        )

    assert queries.duplicate_of(candidate("AAPL")) is not None
    assert queries.duplicate_of(candidate("GOOG")) is None
