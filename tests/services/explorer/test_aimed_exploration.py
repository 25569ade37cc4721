"""Exploration aimed at the failure: the signal's trajectory against its turn's ground truth.

The turn is a real BFCL train turn with earlier turns (its conversation prefix replayed by
the real environment); the model is the shared scripted OpenAI endpoint over HTTP (what
is under test is what the explorer asks and does, not what a model answers).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec

from coevolve.services.abstractor.call_units import call_units
from coevolve.services.abstractor.prompts import RequestDraft, unit_task
from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.handler import (
    Explored,
    ExplorerDeps,
    explore_request,
    explore_signal,
)
from coevolve.services.pool_store.handler import unlabelled_seed
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import (
    config_without_conversation,
    load_turn_tasks,
    seed_pool,
)
from coevolve.shared.failures import failed_calls, failed_in_turn, policy_turns, target_functions
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.messages import (
    ChatMessage,
    ExplorationRequest,
    Signal,
    Task,
    ToolCall,
    Trajectory,
)
from coevolve.shared.structured import RejectionCounter
from tests.support.fake_llm import FakeOpenAI, completion

D0_FILE = Path(__file__).parents[3] / "docs" / "results" / "d0-20261129.json"
SUMMARY = {
    "summary": "The agent called the wrong function.",
    "failure_cause": "It did not look up the stock.",
    "instability_pattern": "Wrong function.",
    "focus_pattern": ["look up stock information"],
    "mistakes_to_avoid": ["calling another function"],
}


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def test_failed_calls_name_missed_wrong_arguments_wrong_function_and_order() -> None:
    a, b, c = call("a", x=1), call("b", y="Zeta"), call("c")
    assert failed_in_turn([a, b], [a, b]) == []
    assert failed_in_turn([a, b], [call("a", x=1.0), call("b", y=" zeta ")]) == []
    [missed] = failed_in_turn([a, b], [a])
    assert (missed.expected, missed.problem, missed.got) == (b, "missed", None)
    [wrong] = failed_in_turn([a], [call("a", x=2)])
    assert wrong.problem == "wrong_arguments" and wrong.got == call("a", x=2)
    [other] = failed_in_turn([b], [c])
    assert other.problem == "wrong_function" and other.got == c
    [order] = failed_in_turn([a, b], [b, a])
    assert order.problem == "wrong_order" and order.expected == b


def prefixed_turn() -> Task:
    """A TradingBot train turn with at least one earlier turn and one call to make."""
    return next(
        t
        for t in seed_pool(classes=["TradingBot"])
        if t.env_config.get("grain") == "turn"
        and t.env_config.get("prior_turns")
        and len(t.ground_truth[0]) == 1
    )


def failed_trajectory(task: Task, made: list[ToolCall], reward: float = 0.0) -> Trajectory:
    """The environment's own conversation for ``task``, then the policy's ``made`` calls."""
    environment = make_environment("bfcl")
    try:
        messages = environment.reset(task)
    finally:
        environment.close()
    answer = ChatMessage(role="assistant", content="(calls)", tool_calls=made)
    return Trajectory(
        id="t0",
        task_id=task.id,
        messages=[*messages, answer],
        token_ids=[],
        logprobs=[],
        loss_mask=[],
        reward=reward,
        policy_version=3,
    )


def test_the_policys_calls_are_those_after_the_replayed_prefix() -> None:
    task = prefixed_turn()
    wrong = call("get_watchlist")
    trajectory = failed_trajectory(task, [wrong])
    assert policy_turns(task, trajectory.messages) == [[wrong]]
    [failure] = failed_calls(task, trajectory)
    assert failure.expected == task.ground_truth[0][0] and failure.got == wrong
    solved = failed_trajectory(task, list(task.ground_truth[0]), reward=1.0)
    assert failed_calls(task, solved) == []


def explore(
    endpoint: FakeOpenAI,
    signal: Signal,
    replies: list[Any],
    summarize_aimed: bool = False,
    rounds: int = 1,
    substitution_rounds: int = 0,
    explore_without_substitution: bool = False,
    composition_rounds: int | None = 0,
    varied_at: dict[str, int] | None = None,
    state_variation_rounds: int = 0,
    siblings: list[Task] | None = None,
    sibling_parents: int = 1,
    repair_children_from_seeds: bool | None = None,
    labelled: bool = True,
    atoms: list[Task] | None = None,
) -> Explored:
    endpoint.reply(*(completion(json.dumps(reply)) for reply in replies))
    section = {"default": {"base_url": endpoint.base_url, "model": "m", "temperature": 0.7}}
    clients = RoleClients(role_settings(section))
    deps = ExplorerDeps(
        summarizer=clients["summarizer"],
        explorer=clients["explorer"],
        config=ExplorerConfig(
            max_steps=1,
            rounds=rounds,
            substitution_rounds=substitution_rounds,
            explore_without_substitution=explore_without_substitution,
            composition_rounds=composition_rounds,
            state_variation_rounds=state_variation_rounds,
            sibling_parents=sibling_parents,
            repair_children_from_seeds=repair_children_from_seeds,
            record=None,
            summarize_aimed=summarize_aimed,
        ),
        summaries=RejectionCounter(),
        actions=RejectionCounter(),
        varied_at={} if varied_at is None else varied_at,
        siblings=None if siblings is None else partial(calling, siblings),
        labelled=labelled,
        atoms=None if atoms is None else partial(on_the_same_state, atoms),
    )

    async def go() -> Explored:
        try:
            return await explore_signal(signal, deps)
        finally:
            await clients.aclose()

    return anyio.run(go)


async def calling(pool: list[Task], task: Task, functions: list[str]) -> list[Task]:
    """What pool-store's ``TasksCalling`` answers, over ``pool``."""
    return [
        other
        for other in pool
        if other.id != task.id and any(c.name in functions for c in other.ground_truth[0])
    ]


async def on_the_same_state(pool: list[Task], task: Task) -> list[Task]:
    """What pool-store's ``AtomsFor`` answers, over ``pool``."""
    start = config_without_conversation(task.env_config)
    return [other for other in pool if config_without_conversation(other.env_config) == start]


def signal_of(task: Task, trajectory: Trajectory) -> Signal:
    return Signal(
        id=f"signal-of-{task.id}",  # fixed: the id seeds which sibling parents are drawn
        kind="boundary",
        task=task,
        trajectory=trajectory,
        group_id="g0",
        policy_version=3,
        evidence={"successes": 2, "failures": 6},
    )


def test_the_explorer_sees_the_conversation_and_the_failing_call_and_calls_it_first(
    endpoint: FakeOpenAI,
) -> None:
    task = prefixed_turn()
    expected = task.ground_truth[0][0]
    wrong = call("get_watchlist")
    signal = signal_of(task, failed_trajectory(task, [wrong]))
    action = {"name": expected.name, "arguments": expected.arguments}
    explored = explore(endpoint, signal, [SUMMARY, action], summarize_aimed=True)
    summarizer_prompt = endpoint.requests[0]["messages"][-1]["content"]
    assert expected.name in summarizer_prompt and "get_watchlist" in summarizer_prompt
    goal = endpoint.requests[1]["messages"][1]["content"]
    earlier_request = " ".join(task.env_config["prior_turns"][-1].split())[:60]
    assert earlier_request in " ".join(goal.split())
    assert " ".join(task.user_turns[0].split())[:60] in " ".join(goal.split())
    assert f"it called get_watchlist() where {expected.name}(" in goal
    # the first call of the round can only be the function the policy got wrong
    schema = json.dumps(endpoint.requests[1]["response_format"])
    assert expected.name in schema and "get_watchlist" not in schema
    assert explored.outcome == "explored" and explored.exploration is not None
    [failure] = explored.exploration.failed_calls
    assert failure.expected == expected and failure.problem == "wrong_function"


def test_by_default_an_aimed_signal_is_explored_without_the_summarizer(
    endpoint: FakeOpenAI,
) -> None:
    task = prefixed_turn()
    expected = task.ground_truth[0][0]
    signal = signal_of(task, failed_trajectory(task, [call("get_watchlist")]))
    action = {"name": expected.name, "arguments": expected.arguments}
    explored = explore(endpoint, signal, [action])
    [request] = endpoint.requests
    goal = request["messages"][1]["content"]
    assert f"it called get_watchlist() where {expected.name}(" in goal
    assert explored.outcome == "explored" and explored.exploration is not None
    assert explored.exploration.context is None


def test_signals_with_nothing_failed_or_too_deep_are_not_explored(endpoint: FakeOpenAI) -> None:
    task = prefixed_turn()
    solved = signal_of(task, failed_trajectory(task, list(task.ground_truth[0]), reward=1.0))
    assert explore(endpoint, solved, []).outcome == "nothing_failed"
    child = msgspec.structs.replace(
        task, lineage=msgspec.structs.replace(task.lineage, depth=1), origin="synthesized"
    )
    deep = signal_of(child, failed_trajectory(child, [call("get_watchlist")]))
    assert explore(endpoint, deep, []).outcome == "too_deep"
    assert endpoint.requests == []


def test_a_substitutable_turn_gives_variants_without_asking_the_llm(
    endpoint: FakeOpenAI,
) -> None:
    task = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_72#t3")
    signal = signal_of(task, failed_trajectory(task, [call("get_user_id", user="David")]))
    explored = explore(endpoint, signal, [], substitution_rounds=2)
    assert explored.outcome == "explored" and explored.exploration is not None
    assert endpoint.requests == []
    rounds = explored.exploration.rounds
    assert len(rounds) == 2 and all(r.replaced and r.request for r in rounds)


def test_a_turn_without_a_substitution_is_explored_by_the_llm_only_when_asked(
    endpoint: FakeOpenAI,
) -> None:
    # "if 'AMZN' appears promising ... the price is larger than 300": conditional
    task = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_115#t1")
    signal = signal_of(task, failed_trajectory(task, [call("get_watchlist")]))
    assert explore(endpoint, signal, [], substitution_rounds=4).outcome == "nothing_to_substitute"
    assert endpoint.requests == []
    expected = task.ground_truth[0][0]
    action = {"name": expected.name, "arguments": {"stock": "NVDA"}}
    explored = explore(
        endpoint, signal, [action], substitution_rounds=4, explore_without_substitution=True
    )
    assert explored.exploration is not None and len(endpoint.requests) == 1
    assert explored.exploration.rounds[0].replaced is None


def test_a_failed_later_turn_is_also_joined_with_the_turn_before_it(
    endpoint: FakeOpenAI,
) -> None:
    task = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_72#t3")
    signal = signal_of(task, failed_trajectory(task, [call("get_user_id", user="David")]))
    explored = explore(endpoint, signal, [], substitution_rounds=2, composition_rounds=2)
    assert endpoint.requests == []
    assert explored.exploration is not None and explored.composed is not None
    composed = explored.composed
    assert composed.id != explored.exploration.id
    assert composed.task.env_config["turn"] == task.env_config["turn"] - 1
    assert composed.signal_version == explored.exploration.signal_version == 3
    assert 1 <= len(composed.rounds) <= 2
    earlier = task.env_config["prior_turns"][-1]
    for joined in composed.rounds:
        assert joined.composed_from is not None and joined.request is not None
        assert joined.request.startswith(earlier.strip().rstrip("."))
        assert len(joined.steps) > len(task.ground_truth[0])
    # composition alone, without substitution, still gives the joined turns
    alone = explore(endpoint, signal, [], substitution_rounds=0, composition_rounds=1)
    assert alone.exploration is None and alone.composed is not None
    assert len(alone.composed.rounds) == 1


def test_with_no_labels_a_failed_lookup_is_composed_with_more_discovered_tasks(
    endpoint: FakeOpenAI,
) -> None:
    # a D0 lookup without arguments gives no substitution and no state variant with
    # another request: by default, composition makes up to 3 turns of it with no labels
    d0 = unlabelled_seed(D0_FILE)  # the pool's seed tasks of a run with no labels
    task = next(t for t in d0 if t.ground_truth[0][0].name == "get_order_history")
    signal = signal_of(task, failed_trajectory(task, [call("get_account_info")]))
    made = {
        labelled: explore(
            endpoint, signal, [], composition_rounds=None, labelled=labelled, atoms=d0
        )
        for labelled in (True, False)
    }
    assert endpoint.requests == []
    counts = {}
    for labelled, explored in made.items():
        assert explored.composed is not None
        for joined in explored.composed.rounds:
            names = [step.action.name for step in joined.steps]
            assert "get_order_history" in names and len(names) >= 2
        counts[labelled] = len(explored.composed.rounds)
    assert counts == {True: 1, False: 3}


def test_a_vary_request_runs_the_same_machinery_aimed_at_nothing(endpoint: FakeOpenAI) -> None:
    task = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_72#t3")
    section = {"default": {"base_url": endpoint.base_url, "model": "m", "temperature": 0.7}}
    clients = RoleClients(role_settings(section))
    deps = ExplorerDeps(
        summarizer=clients["summarizer"],
        explorer=clients["explorer"],
        config=ExplorerConfig(substitution_rounds=2, composition_rounds=1, record=None),
        summaries=RejectionCounter(),
        actions=RejectionCounter(),
    )
    request = ExplorationRequest(task=task, vary=True)

    async def go() -> Explored:
        try:
            return await explore_request(request, deps)
        finally:
            await clients.aclose()

    explored = anyio.run(go)
    assert endpoint.requests == []  # no LLM: variants and composed turns by code
    assert explored.exploration is not None and explored.composed is not None
    for exploration in explored.explorations:
        assert exploration.mode == "unguided" and exploration.signal_id is None
        assert exploration.failed_calls == []
    assert all(r.replaced for r in explored.exploration.rounds)
    assert all(r.composed_from for r in explored.composed.rounds)
    # what the abstractor makes of them is synthesized, like a signal's children
    for exploration in explored.explorations:
        unit = call_units(exploration, lambda: make_environment("bfcl"), 4)[0]
        request_text = unit.request or task.user_turns[0]
        child = unit_task(RequestDraft(request_text, request_text), unit, exploration, 0)
        assert child.origin == "synthesized" and child.lineage.signal_id is None


def test_a_turn_varied_for_a_recent_signal_is_not_varied_again(endpoint: FakeOpenAI) -> None:
    task = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_72#t3")
    signal = signal_of(task, failed_trajectory(task, [call("get_user_id", user="David")]))
    varied_at: dict[str, int] = {}
    first = explore(endpoint, signal, [], substitution_rounds=2, varied_at=varied_at)
    assert first.outcome == "explored" and varied_at == {task.id: signal.policy_version}
    again = msgspec.structs.replace(signal, id="signal-2", policy_version=signal.policy_version + 4)
    skipped = explore(endpoint, again, [], substitution_rounds=2, varied_at=varied_at)
    assert skipped.outcome == "recently_varied" and skipped.explorations == []
    later = msgspec.structs.replace(signal, id="signal-3", policy_version=signal.policy_version + 5)
    assert explore(endpoint, later, [], substitution_rounds=2, varied_at=varied_at).outcome == (
        "explored"
    )
    assert varied_at[task.id] == signal.policy_version + 5


def test_a_failure_is_also_varied_from_another_turn_calling_the_failed_function(
    endpoint: FakeOpenAI,
) -> None:
    turns = load_turn_tasks()
    task = next(t for t in turns if t.id == "multi_turn_base_72#t3")
    signal = signal_of(task, failed_trajectory(task, [call("get_user_id", user="David")]))
    varied_at: dict[str, int] = {}
    explored = explore(
        endpoint, signal, [], substitution_rounds=1, siblings=turns, varied_at=varied_at
    )
    assert endpoint.requests == []
    parents = {e.task.id for e in explored.explorations}
    [sibling] = parents - {task.id}
    assert task.id in parents and set(varied_at) == {task.id, sibling}
    sibling_task = next(t for t in turns if t.id == sibling)
    targets = set(target_functions(failed_calls(task, signal.trajectory)))
    assert targets & {c.name for c in sibling_task.ground_truth[0]}
    for exploration in explored.explorations:  # every child answers the same signal
        assert exploration.signal_id == signal.id and exploration.failed_calls
    # within the cooldown the signal's own turn rests, and another sibling is varied
    again = msgspec.structs.replace(signal, id="signal-2", policy_version=4)
    later = explore(endpoint, again, [], substitution_rounds=1, siblings=turns, varied_at=varied_at)
    assert later.outcome == "explored"
    assert {e.task.id for e in later.explorations}.isdisjoint({task.id, sibling})


def test_a_failed_child_is_repaired_from_the_seed_turns_calling_what_it_got_wrong(
    endpoint: FakeOpenAI,
) -> None:
    turns = load_turn_tasks()
    seed = next(t for t in turns if t.id == "multi_turn_base_72#t3")
    child = msgspec.structs.replace(
        seed,
        id="child-of-72-t3",
        lineage=msgspec.structs.replace(seed.lineage, depth=1, parent_task_id=seed.id),
        origin="synthesized",
    )
    signal = signal_of(child, failed_trajectory(child, [call("get_user_id", user="David")]))
    pool = [*turns, child]
    off = explore(endpoint, signal, [], substitution_rounds=1, siblings=pool, sibling_parents=2)
    assert off.outcome == "too_deep"

    varied_at: dict[str, int] = {}
    repaired = explore(
        endpoint,
        signal,
        [],
        substitution_rounds=1,
        siblings=pool,
        sibling_parents=2,
        varied_at=varied_at,
        repair_children_from_seeds=True,
    )
    assert repaired.outcome == "explored" and endpoint.requests == []
    parents = {e.task.id for e in repaired.explorations}
    assert parents and child.id not in parents and set(varied_at) == parents
    targets = set(target_functions(failed_calls(child, signal.trajectory)))
    for parent in (t for t in turns if t.id in parents):
        assert parent.lineage.depth == 0
        assert targets & {c.name for calls in parent.ground_truth for c in calls}
    for exploration in repaired.explorations:
        assert exploration.signal_id == signal.id and exploration.failed_calls


def test_a_failed_turn_is_also_varied_on_another_state(endpoint: FakeOpenAI) -> None:
    task = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_72#t3")
    signal = signal_of(task, failed_trajectory(task, [call("get_user_id", user="David")]))
    explored = explore(endpoint, signal, [], state_variation_rounds=1)
    assert explored.outcome == "explored" and endpoint.requests == []
    [on_state] = explored.explorations
    [round_] = on_state.rounds
    assert round_.varied_state and round_.request  # code wrote it: the ids renamed in it too
    assert on_state.task.initial_state != task.initial_state
    assert [s.action.name for s in round_.steps] == [c.name for c in task.ground_truth[0]]
