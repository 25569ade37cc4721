"""The role prompts and their schemas: real BFCL tools, xgrammar grammars, jsonschema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from coevolve.services.abstractor.call_units import CallUnit
from coevolve.services.abstractor.prompts import (
    FIRST_MESSAGE,
    GAP_CHARS,
    RequestDraft,
    describe_call,
    lacks_plain_words,
    repeated_phrase,
    request_messages,
    request_problems,
    request_schema,
    unit_task,
    values_pattern,
)
from coevolve.services.explorer.prompts import (
    CONTEXT_SCHEMA,
    GOAL_TEMPLATES,
    describe_signal,
    exploration_goal,
    exploration_messages,
    render_trajectory,
    summarizer_messages,
    unguided_goal,
)
from coevolve.services.judge.prompts import (
    CRITERIA,
    JUDGE_SCHEMA,
    Criteria,
    Judgment,
    decide,
    judge_messages,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import (
    SIGNAL_KINDS,
    ChatMessage,
    Exploration,
    ExplorationContext,
    ExplorationRound,
    InteractionStep,
    Signal,
    SignalKind,
    Task,
    ToolCall,
    Trajectory,
)
from coevolve.shared.structured import Rejection, function_call_schema, parse_structured
from tests.support.messages import EXPLORATION_CONTEXT as CONTEXT
from tests.support.messages import untokenized_trajectory


@pytest.fixture(scope="module")
def bfcl() -> tuple[Task, list[dict[str, Any]]]:
    task = seed_tasks()[0]
    environment = make_environment("bfcl")
    environment.reset(task)
    tools = environment.tools()
    environment.close()
    return task, tools


def grammar(schema: dict[str, Any]) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )


def compact(value: Any) -> str:
    return json.dumps(msgspec.to_builtins(value), separators=(",", ":"), ensure_ascii=False)


def flagged_trajectory(task: Task) -> Trajectory:
    messages = [ChatMessage(role="user", content=task.user_turns[0])]
    for i in range(30):
        messages.append(
            ChatMessage(
                role="assistant",
                content="",
                tool_calls=[ToolCall(name="ls", arguments={"a": i % 2 == 0})],
            )
        )
        messages.append(ChatMessage(role="tool", content="file_" * 40 + str(i)))
    messages.append(ChatMessage(role="assistant", content="I could not finish the task."))
    return untokenized_trajectory("traj-1", task.id, messages, policy_version=2)


EVIDENCE: dict[SignalKind, dict[str, Any]] = {
    "forgetting": {"best_in_window": 1.0, "current_score": 0.25, "window_size": 10},
    "boundary": {"successes": 3, "failures": 5, "success_actions": ["cd", "touch"]},
    "rare": {"pattern": "touch->echo", "frequency": 0.012},
    "uncertainty": {"mean_entropy": 2.31, "quantile": 0.9, "threshold": 1.7},
}
SIGNAL_WORDS = {
    "forgetting": ["FORGETTING", "1.00", "0.25"],
    "boundary": ["BOUNDARY", "3 succeeded", "5 failed", "cd, touch"],
    "rare": ["RARE", "`touch->echo`", "1.2%"],
    "uncertainty": ["UNCERTAINTY", "2.31", "90.0%", "1.70"],
}


# --------------------------------------------------------------------------- summarizer


@pytest.mark.parametrize("kind", SIGNAL_KINDS)
def test_summarizer_prompt_per_signal_kind(kind: SignalKind, bfcl: tuple[Task, list[Any]]) -> None:
    task, _ = bfcl
    signal = Signal(
        kind=kind,
        task=task,
        trajectory=flagged_trajectory(task),
        group_id="g",
        policy_version=2,
        evidence=EVIDENCE[kind],
    )
    messages = summarizer_messages(signal)
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    for word in SIGNAL_WORDS[kind]:
        assert word in user
    assert task.user_turns[0][:40] in user
    assert "messages omitted" in user  # the 62-message episode was cut to its budget
    assert "I could not finish the task." in user  # the ending is kept
    for field in CONTEXT_SCHEMA["required"]:
        assert f"- {field}:" in user
    assert len(user) < 6000


def test_boundary_by_margin_names_the_best_attempt_not_a_success() -> None:
    words = describe_signal(
        "boundary",
        {"successes": 0, "failures": 8, "spread": 0.2, "success_actions": ["cd", "mv"]},
    )
    assert "no attempt" in words and "0.20" in words
    assert "The best attempt called: cd, mv." in words and "succeeded" not in words


def test_context_schema_grammar_and_type_agree() -> None:
    good = compact(CONTEXT)
    assert _is_grammar_accept_string(grammar(CONTEXT_SCHEMA), good)
    jsonschema.validate(json.loads(good), CONTEXT_SCHEMA)
    assert parse_structured(good, ExplorationContext) == CONTEXT
    too_long = compact(msgspec.structs.replace(CONTEXT, summary="x" * 301))
    assert not _is_grammar_accept_string(grammar(CONTEXT_SCHEMA), too_long)
    no_focus = compact(msgspec.structs.replace(CONTEXT, focus_pattern=[]))
    assert not _is_grammar_accept_string(grammar(CONTEXT_SCHEMA), no_focus)


def test_render_trajectory_keeps_short_episodes_whole(bfcl: tuple[Task, list[Any]]) -> None:
    task, _ = bfcl
    short = msgspec.structs.replace(
        flagged_trajectory(task), messages=flagged_trajectory(task).messages[:3]
    )
    text = render_trajectory(short)
    assert "omitted" not in text and text.count("\n") == 2
    assert text.startswith("[user] ") and '[assistant calls] ls({"a": true})' in text


# --------------------------------------------------------------------------- exploration


@pytest.mark.parametrize("kind", SIGNAL_KINDS)
def test_exploration_goal_per_kind(kind: SignalKind, bfcl: tuple[Task, list[Any]]) -> None:
    task, _ = bfcl
    goal = exploration_goal(kind, CONTEXT, task)
    assert CONTEXT.failure_cause in goal and CONTEXT.focus_pattern[0] in goal
    assert task.user_turns[0][:40] in goal
    assert goal.startswith(GOAL_TEMPLATES[kind].split("\n", 1)[0])


def test_family_wording_follows_the_paper() -> None:
    assert "different argument values" in GOAL_TEMPLATES["forgetting"]
    assert "simple uses to more complex" in GOAL_TEMPLATES["forgetting"]
    assert "edge cases" in GOAL_TEMPLATES["rare"]
    assert "distinguishes a success from a failure" in GOAL_TEMPLATES["boundary"]


def test_exploration_messages_list_real_tools_and_trim_history(
    bfcl: tuple[Task, list[Any]],
) -> None:
    task, tools = bfcl
    steps = [(f'{{"name":"ls","arguments":{{"n":{i}}}}}', f"result {i}") for i in range(9)]
    messages = exploration_messages(tools, unguided_goal(task), steps, max_history=4)
    system = messages[0]["content"]
    assert "- cd(folder: string)" in system and "close_ticket(ticket_id: integer)" in system
    assert "This tool belongs to" not in system
    assert len(system) < 5500
    assert "(5 earlier steps of this round are not shown.)" in messages[1]["content"]
    assert [m["role"] for m in messages[2:]] == ["assistant", "user"] * 4
    assert messages[2]["content"] == steps[5][0]
    assert messages[-1]["content"].startswith("Observation: result 8")


def test_action_schema_allows_only_real_functions(bfcl: tuple[Task, list[Any]]) -> None:
    _, tools = bfcl
    schema = function_call_schema(tools)
    action = grammar(schema)
    assert _is_grammar_accept_string(action, '{"name":"cd","arguments":{"folder":"documents"}}')
    assert _is_grammar_accept_string(action, '{"name":"close_ticket","arguments":{"ticket_id":3}}')
    assert not _is_grammar_accept_string(action, '{"name":"rm_rf","arguments":{}}')
    assert not _is_grammar_accept_string(action, '{"name":"cd","arguments":{"folder":7}}')
    assert not _is_grammar_accept_string(action, '{"name":"cd","arguments":{}}')  # required
    jsonschema.validate({"name": "cd", "arguments": {"folder": "x"}}, schema)


# --------------------------------------------------------------------------- abstractor


def exploration_of(task: Task) -> Exploration:
    steps = [
        InteractionStep(
            history=[],
            action=ToolCall(name="cd", arguments={"folder": "documents"}),
            observation='{"current_working_directory": "documents"}',
        ),
        InteractionStep(
            history=[],
            action=ToolCall(name="touch", arguments={"file_name": "a.txt"}),
            observation="None",
        ),
    ]
    return Exploration(
        id="expl-1",
        mode="guided",
        task=task,
        rounds=[ExplorationRound(steps=steps), ExplorationRound(steps=steps[:1])],
        context=CONTEXT,
        signal_id="sig-1",
        signal_kind="boundary",
    )


UNIT = CallUnit(
    calls=[
        ToolCall(name="cd", arguments={"folder": "documents"}),
        ToolCall(name="touch", arguments={"file_name": "a.txt"}),
    ],
    observations=['{"current_working_directory": "documents"}', "None"],
    changes_state=True,
)
DRAFT = RequestDraft(
    description="Create a notes file in documents.",
    request="Go into the documents folder and create a file named 'a.txt' there.",
)


def test_request_schema_holds_a_request_and_nothing_else() -> None:
    schema = request_schema()
    good = compact(DRAFT)
    assert _is_grammar_accept_string(grammar(schema), good)
    jsonschema.validate(json.loads(good), schema)
    assert parse_structured(good, RequestDraft) == DRAFT
    with_calls = good[:-1] + ',"calls":[]}'
    assert not _is_grammar_accept_string(grammar(schema), with_calls)
    too_long = compact(msgspec.structs.replace(DRAFT, request="word " * 100))
    assert not _is_grammar_accept_string(grammar(schema), too_long)


def test_a_request_schema_with_values_accepts_only_requests_that_write_them() -> None:
    schema = request_schema(["AAPL", 210.65, 10])

    def accepts(request: str) -> bool:
        draft = RequestDraft(description="Buy shares.", request=request)
        return _is_grammar_accept_string(grammar(schema), compact(draft))

    assert accepts("Please buy 10 shares of aapl at 210.65 each.")
    assert accepts("At 210.65 a share, get me 10 of AAPL")
    assert not accepts("Please buy some shares of AAPL at 210.65 each.")  # no 10
    assert not accepts("Buy 10 shares at 210.65.")  # no symbol
    # code is refused while it is written, not after: the arguments or a result copied
    assert not accepts("{'symbol': 'AAPL', 'amount': 10, 'price': 210.65}")
    assert not accepts("arguments: symbol = AAPL, amount = 10, price = 210.65")
    assert not accepts("Buy shares. arguments: AAPL 10 210.65 returned: order")
    assert not accepts("Call place_order for AAPL, 10 at 210.65")
    assert accepts("Buy 10 of AAPL (at 210.65, please), that's all.")
    # with no value to write, prose alone: code still cannot enter
    prose = grammar(request_schema((), prose=True))
    for request, ok in (("Show me my watchlist.", True), ("get_watchlist()", False)):
        draft = compact(RequestDraft(description="d", request=request))
        assert _is_grammar_accept_string(prose, draft) is ok
    # a value JSON must escape is not required; the others still are
    assert values_pattern(['say "hi"', "USR005"]) == values_pattern(["USR005"])
    assert _is_grammar_accept_string(
        grammar(request_schema(["USR005", "See you at noon?"])),
        compact(
            RequestDraft(description="d", request="Tell USR005 this, see you at noon? Thanks.")
        ),
    )


def test_request_prompt_shows_the_calls_their_functions_and_results(
    bfcl: tuple[Task, list[Any]],
) -> None:
    task, tools = bfcl
    user = request_messages(exploration_of(task), UNIT, tools)[1]["content"]
    assert "1. It does: " in user and '   arguments: folder = "documents"' in user
    assert '   returned: {"current_working_directory": "documents"}' in user
    assert "2. It does: " in user and 'file_name = "a.txt"' in user
    # a first turn: no conversation yet, the parent's request shown as what the user once said
    assert f"{FIRST_MESSAGE}\n(At this point the user once said: {task.user_turns[0]!r})" in user
    assert f"- {task.user_turns[0]}" not in user
    assert 'never a function name, code, JSON, a log line, or a list of "name: value"' in user
    # with the conversation before the request: its messages, and how its user spoke
    earlier = [
        ChatMessage(role="user", content="Move into my documents folder."),
        ChatMessage(role="assistant", content="", tool_calls=[ToolCall(name="cd")]),
        ChatMessage(role="tool", content='{"current_working_directory": "documents"}'),
    ]
    continued = request_messages(exploration_of(task), UNIT, tools, earlier)[1]["content"]
    assert "user: Move into my documents folder.\nassistant: (made 1 call)\ntool: {" in continued
    assert "made 1 call" in continued and "(did): cd" not in continued  # no name to copy
    assert f"(At this point the user once said: {task.user_turns[0]!r})" in continued
    # without results: nothing returned to copy, the values still there
    bare = request_messages(exploration_of(task), UNIT, tools, show_results=False)[1]["content"]
    assert "returned" not in bare and 'file_name = "a.txt"' in bare
    # identifiers are shown as words, so the request has none to copy
    assert describe_call(1, "place_order", {"symbol": "AAPL"}, None).startswith(
        "1. It does: place order"
    )


def test_request_problems(bfcl: tuple[Task, list[Any]]) -> None:
    _, tools = bfcl
    names = {t["function"]["name"] for t in tools}
    assert request_problems(DRAFT, names) == []
    # a function's name, or a log line, is not what a user asks
    for request in ("touch", "get_exchange_rate({}) -> {'exchanged_value': 0.5}"):
        named = msgspec.structs.replace(DRAFT, request=request)
        assert request_problems(named, names)[0] == "a request of fewer than 3 plain words"
    # call syntax inside an otherwise plain sentence is what the judge rejects as well
    coded = msgspec.structs.replace(DRAFT, request="Please run touch(file_name='a.txt') there.")
    assert request_problems(coded, names) == ["written as code: touch(file_name='a.txt')"]
    trading = msgspec.structs.replace(DRAFT, request="Use place_order to buy 10 shares of AAPL.")
    assert request_problems(trading, {"place_order"}, ["place_order"]) == [
        "written as code: place_order"
    ]
    # a request for another function of the environment than the one called
    tires = msgspec.structs.replace(DRAFT, request="Check tire pressure on all four wheels.")
    offered = {"check_tire_pressure", "adjustClimateControl"}
    assert request_problems(tires, offered, ["adjustClimateControl"]) == [
        "it asks to check tire pressure, which these calls do not do"
    ]
    assert request_problems(tires, offered, ["check_tire_pressure"]) == []
    empty = RequestDraft(description=" ", request=" ")
    assert request_problems(empty, names) == ["empty description", "empty request"]


def test_unit_task_keeps_state_and_lineage(bfcl: tuple[Task, list[Any]]) -> None:
    task, _ = bfcl
    exploration = exploration_of(task)
    candidate = unit_task(DRAFT, UNIT, exploration, 0, signal_evidence={"rewards": [1.0, 0.0]})
    assert candidate.initial_state == task.initial_state and candidate.env_config == task.env_config
    assert candidate.user_turns == [DRAFT.request] and candidate.ground_truth == [UNIT.calls]
    assert candidate.description == DRAFT.description and candidate.origin == "synthesized"
    assert candidate.lineage.parent_task_id == task.id
    assert candidate.lineage.signal_kind == "boundary" and candidate.lineage.exploration_steps == 3
    assert candidate.lineage.signal_evidence == {"rewards": [1.0, 0.0]}
    again = unit_task(DRAFT, UNIT, exploration, 0)
    assert again.id == candidate.id and again.lineage.candidate_id == candidate.lineage.candidate_id
    assert unit_task(DRAFT, UNIT, exploration, 1).id != candidate.id
    unguided = msgspec.structs.replace(exploration, mode="unguided", context=None)
    assert unit_task(DRAFT, UNIT, unguided, 0).origin == "explored"


# --------------------------------------------------------------------------- judge


JUDGED = Task(
    id="cand",
    environment="bfcl",
    description="Create a notes file in documents.",
    user_turns=["Go to documents and create a.txt.", "Now show me the files."],
    ground_truth=[
        [
            ToolCall(name="cd", arguments={"folder": "documents"}),
            ToolCall(name="touch", arguments={"file_name": "a.txt"}),
        ],
        [ToolCall(name="ls")],
    ],
)


def test_judge_prompt_aligns_calls_with_replay_results() -> None:
    user = judge_messages(JUDGED, ["documents", "None"], ["ls: not executed"], self_score=1.0)[1][
        "content"
    ]
    assert 'call cd({"folder": "documents"})\n    -> documents' in user
    assert 'call touch({"file_name": "a.txt"})\n    -> None' in user
    assert "call ls({})\n    -> (not executed)" in user
    assert "Replay errors:\n  - ls: not executed" in user
    assert "scores 1.00 against itself" in user
    for name in CRITERIA:
        assert name in user


def test_judge_schema_grammar_and_type_agree() -> None:
    judgment = Judgment(
        criteria=Criteria(True, True, True, True, True), accept=True, reason="All calls ran."
    )
    good = compact(judgment)
    assert _is_grammar_accept_string(grammar(JUDGE_SCHEMA), good)
    jsonschema.validate(json.loads(good), JUDGE_SCHEMA)
    assert parse_structured(good, Judgment) == judgment
    missing = good.replace(',"final_result":true', "")
    assert not _is_grammar_accept_string(grammar(JUDGE_SCHEMA), missing)
    assert isinstance(parse_structured(missing, Judgment), Rejection)


@pytest.mark.parametrize(
    ("accept", "criteria", "accepted", "extra"),
    [
        (True, (True,) * 5, True, []),
        (True, (True, True, True, False, True), False, ["criterion failed: final_result"]),
        (False, (True,) * 5, False, ["judge rejected the task"]),
    ],
)
def test_decide(accept: bool, criteria: tuple[bool, ...], accepted: bool, extra: list[str]) -> None:
    ok, reasons, table = decide(Judgment(criteria=Criteria(*criteria), accept=accept, reason="r"))
    assert ok is accepted
    assert reasons[0] == "r"
    for line in extra:
        assert line in reasons
    assert list(table) == list(CRITERIA)


def test_a_rewrite_for_too_few_words_opens_with_three_plain_words() -> None:
    def accepts(schema: dict[str, Any], request: str) -> bool:
        draft = compact(RequestDraft(description="d", request=request))
        return _is_grammar_accept_string(grammar(schema), draft)

    free, lead = request_schema(["USR005"], prose=True), request_schema(["USR005"], lead_words=3)
    for request in ("USR005", "USR005 messages", "Messages USR005"):
        assert accepts(free, request) and not accepts(lead, request)
    assert accepts(lead, "Show me every message sent by USR005.")
    assert not accepts(lead, "Show me get_watchlist USR005")  # code still cannot enter
    prose = request_schema((), prose=True, lead_words=3)
    assert accepts(prose, "Show my sent messages.") and not accepts(prose, "Messages sent.")
    assert lacks_plain_words(["a request of fewer than 3 plain words"])
    assert lacks_plain_words(["written as code: 1 plain words before its details"])
    assert not lacks_plain_words(["written as code: get_watchlist"])


def test_the_text_around_the_values_is_bounded() -> None:
    def accepts(schema: dict[str, Any], request: str) -> bool:
        draft = compact(RequestDraft(description="d", request=request))
        return _is_grammar_accept_string(grammar(schema), draft)

    schema = request_schema([20.0])
    ramble = "I would really like you to help me with the car today, " * 3
    assert len(ramble) > GAP_CHARS
    assert accepts(schema, "Please add 20 gallons of fuel to my tank.")
    assert not accepts(schema, ramble + "add 20 gallons.")  # the value comes too late
    assert not accepts(schema, "Add 20 gallons. " + ramble)  # and nothing rambles after it
    prose = request_schema((), prose=True)
    assert accepts(prose, "Show me my watchlist.") and not accepts(prose, ramble * 2)


def test_a_padded_or_overlong_request_is_refused(bfcl: tuple[Task, list[Any]]) -> None:
    _, tools = bfcl
    names = {t["function"]["name"] for t in tools}
    padded = (
        "Retrieve the details of my most recent order, as I've misplaced the ID but need the "
        "latest transaction. Access and get 12345 details of an order, as I've misplaced the "
        "ID but need the latest transaction."
    )
    assert repeated_phrase(padded) == "order as i've misplaced the"
    problems = request_problems(RequestDraft(description="d", request=padded), names)
    assert any("twice" in problem for problem in problems)
    long = "Please check the details of order 12345 for me now. " * 7
    assert any("longer than" in p for p in request_problems(RequestDraft("d", long), names))
    assert not request_problems(RequestDraft("d", "Get the details for order 12345."), names)
    turns = [turn for task in seed_tasks() for turn in task.user_turns]
    assert sum(repeated_phrase(turn) is not None for turn in turns) <= 0.01 * len(turns)


def test_the_text_budget_is_shared_by_the_gaps() -> None:
    one, four = values_pattern(["AAPL"]), values_pattern(["a1", "b2", "c3", "d4"])
    assert "{0,120}" in one and "{0,48}" in four
    assert "{0,40}" in values_pattern([f"v{i}" for i in range(9)])


def test_a_value_is_not_glued_to_a_word() -> None:
    def accepts(request: str) -> bool:
        draft = compact(RequestDraft(description="d", request=request))
        return _is_grammar_accept_string(grammar(request_schema(["USR002", 12345])), draft)

    assert accepts("Send it to USR002 about order 12345.")
    assert accepts("USR002 should hear about order #12345")
    assert not accepts("It would be veryusr002 helpful, order 12345.")
    assert not accepts("Tell USR002 about order a12345.")
    assert not accepts("Tell USR002s about order 12345.")
