"""The judge's deterministic checks on real BFCL train-split turns in a real environment."""

from __future__ import annotations

from functools import cache

import msgspec
import pytest

from coevolve.services.judge.checks import (
    SEMANTIC_CRITERIA,
    TextIndex,
    check_arguments_named,
    check_description_covered,
    check_intent,
    check_minimality,
    enum_options,
    is_free_text,
    names,
    placeholder_values,
    semantic_checks,
    trace_calls,
)
from coevolve.shared.argument_values import is_salient
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl.tasks import MULTI_TURN_CATEGORIES, load_tasks, suite_tasks
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.wording import call_syntax


@cache
def _train_turns() -> dict[str, Task]:
    return {task.id: task for task in suite_tasks("bfcl-turns-base", "train")}


def turn(task_id: str) -> Task:
    return msgspec.structs.replace(_train_turns()[task_id])


def bfcl() -> Environment:
    return make_environment("bfcl")


def with_calls(task: Task, calls: list[ToolCall]) -> Task:
    return msgspec.structs.replace(task, ground_truth=[calls])


def with_request(task: Task, request: str) -> Task:
    return msgspec.structs.replace(task, user_turns=[request])


# multi_turn_base_2#t0: "Go into document folder and ... create a document titled
# 'TeamNotes.txt' ..." -> cd(documents), touch(TeamNotes.txt)
CREATE = "multi_turn_base_2#t0"
# multi_turn_base_38#t0: find 'findings_report' in 'SuperResearch', remove it and the folder
REMOVE = "multi_turn_base_38#t0"
# multi_turn_base_62#t1: "verify that all the doors on my car are securely locked"
DOORS = "multi_turn_base_62#t1"
# multi_turn_base_100#t0: "I've got my eye on Nvidia ... its current stock price" -> NVDA
STOCK = "multi_turn_base_100#t0"


def test_ground_truth_turns_pass_every_check() -> None:
    for task_id in (CREATE, DOORS, STOCK):
        task = turn(task_id)
        results = semantic_checks(task, bfcl, backend="ngram")
        assert [r.name for r in results] == list(SEMANTIC_CRITERIA)
        assert all(r.passed for r in results), (task_id, [r.reasons for r in results])


WATCH_NVDA = [ToolCall(name="add_to_watchlist", arguments={"stock": "NVDA"})]


def failed_checks(task: Task) -> dict[str, list[str]]:
    return {r.name: r.reasons for r in semantic_checks(task, bfcl, backend="ngram") if not r.passed}


def test_a_request_written_as_a_call_is_rejected() -> None:
    """A task a default run accepted: a call and a log line for a request, and a value
    (Zeta Corp) the call does not use."""
    task = with_request(
        with_calls(turn(STOCK), WATCH_NVDA),
        """remove_from_watchlist({"stock": "Zeta Corp"}) Details: stock 'NVDA'.""",
    )
    failed = failed_checks(task)
    assert "plain_request" in failed
    assert "remove_from_watchlist" in failed["plain_request"][0]


def test_a_request_for_the_opposite_of_its_call_is_rejected() -> None:
    task = with_request(
        with_calls(turn(STOCK), WATCH_NVDA), "Please remove NVDA from my stock watchlist."
    )
    failed = failed_checks(task)
    assert list(failed) == ["same_action"]
    assert "'remove'" in failed["same_action"][0]
    fixed = with_request(task, "Please add NVDA to my stock watchlist.")
    assert failed_checks(fixed) == {}


@pytest.mark.parametrize(
    "request_text",
    [
        "Add NVDA to my watchlist with add_to_watchlist.",
        'Add {"stock": "NVDA"} to my watchlist.',
        "Call get_stock_info() and then add NVDA to my watchlist.",
        # the abstractor's prompt echoed, and an HTTP request line: both seen in a run
        'add to watchlist: Adds a stock. arguments: stock = "NVDA" returned: {',
        "POST https://example.com/nvda/watchlist",
        # an argument assigned, and a degenerate loop: both from a 1.5B abstractor
        'Add to my watchlist: stock_symbol = "NVDA"',
        "Add NVDA to my watchlist; add NVDA to my watchlist; add NVDA to my watchlist;",
        # about the call or the assistant, not asking for it: both accepted in a default run
        "What does this call do? Details: stock 'NVDA'.",
        "To keep my portfolio safe, the assistant needs to watch NVDA. Please provide this "
        "information in your request.",
        # the abstractor's prompt echoed in words: both accepted in a default run (run 28)
        "make 1 call, it does Add a stock to the watchlist with stock 'NVDA'.",
        "Add a stock to the watchlist, 'NVDA'. arguments(stock)",
    ],
)
def test_call_syntax_in_any_form_is_found(request_text: str) -> None:
    task = with_request(with_calls(turn(STOCK), WATCH_NVDA), request_text)
    assert "plain_request" in failed_checks(task)


CLIMATE = [
    ToolCall(
        name="adjustClimateControl",
        arguments={"temperature": 35.0, "unit": "celsius", "fanSpeed": 12, "mode": "heat"},
    )
]
CLIMATE_DETAILS = "Details: temperature 35.0; unit 'celsius'; fanSpeed 12; mode 'heat'."


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        ("Check tire pressure", "check_tire_pressure"),
        ("Get the current speed of the vehicle", "get_current_speed"),
        # also naming the called one does not excuse asking for another
        ("Get the current speed, then adjust the climate control", "get_current_speed"),
    ],
)
def test_a_request_naming_another_function_of_its_class_is_rejected(asked: str, named: str) -> None:
    """Tasks default runs accepted: the request names one function, the call is another."""
    task = with_request(with_calls(turn(DOORS), CLIMATE), f"{asked} {CLIMATE_DETAILS}")
    failed = failed_checks(task)
    assert "same_action" in failed
    assert named in failed["same_action"][0]
    fixed = with_request(
        task, "Adjust the climate control to 35 degrees celsius, fan speed 12, in heat mode."
    )
    assert "same_action" not in failed_checks(fixed)


def test_a_redundant_state_changing_call_is_named() -> None:
    task = turn(CREATE)
    calls = [
        *task.ground_truth[0],
        ToolCall(name="echo", arguments={"content": "draft", "file_name": "TeamNotes.txt"}),
        ToolCall(name="echo", arguments={"content": "ideas", "file_name": "TeamNotes.txt"}),
    ]
    result = check_minimality(with_calls(task, calls), bfcl)
    assert not result.passed
    # the first echo is overwritten by the second: the final state is the same without it
    assert result.details == {"state_changing_calls": 3, "redundant_calls": 1}
    assert len(result.reasons) == 1
    assert "turn 1 call 3 echo(" in result.reasons[0] and '"draft"' in result.reasons[0]


def test_reads_are_not_state_changing_calls() -> None:
    task = turn(CREATE)
    calls = [*task.ground_truth[0], ToolCall(name="ls"), ToolCall(name="pwd")]
    trace = trace_calls(with_calls(task, calls), bfcl)
    # cd moves a private cursor: not part of the state BFCL compares
    assert [c.changed_state for c in trace.calls] == [False, True, False, False]
    assert check_minimality(with_calls(task, calls), bfcl, trace).passed


def test_a_wrong_symbol_is_not_named_by_the_request() -> None:
    task = turn(STOCK)
    assert check_arguments_named(task, trace_calls(task, bfcl)).passed  # NVDA: Nvidia
    tesla = with_calls(task, [ToolCall(name="get_stock_info", arguments={"symbol": "TSLA"})])
    result = check_arguments_named(tesla, trace_calls(tesla, bfcl))
    assert not result.passed
    assert "get_stock_info: 'TSLA'" in result.reasons[0]


def test_one_unnamed_value_among_several_is_tolerated_two_are_not() -> None:
    task = turn(CREATE)  # cd(documents) named as "document folder", touch('TeamNotes.txt')
    one = [task.ground_truth[0][0], ToolCall(name="touch", arguments={"file_name": "Budget.txt"})]
    result = check_arguments_named(with_calls(task, one), trace_calls(with_calls(task, one), bfcl))
    assert result.passed and result.details["unnamed"] == 1
    two = [
        ToolCall(name="cd", arguments={"folder": "Archived"}),
        ToolCall(name="touch", arguments={"file_name": "Budget.txt"}),
    ]
    corrupted = with_calls(task, two)
    result = check_arguments_named(corrupted, trace_calls(corrupted, bfcl))
    assert not result.passed and result.details["unnamed"] == 2


def test_an_enumerated_value_counts_only_when_the_request_names_an_option() -> None:
    task = turn(DOORS)  # "all the doors": lockDoors(door=[driver, passenger, ...])
    trace = trace_calls(task, bfcl)
    assert enum_options(trace.tools)[("lockDoors", "door")][:2] == ["driver", "passenger"]
    assert check_arguments_named(task, trace).passed
    # naming one door but locking another is a wrong value
    named = with_request(task, "Please lock the passenger door of my car.")
    calls = [ToolCall(name="lockDoors", arguments={"unlock": False, "door": ["driver"]})]
    corrupted = with_calls(named, calls)
    result = check_arguments_named(corrupted, trace_calls(corrupted, bfcl))
    assert not result.passed and "'driver'" in result.reasons[0]


def test_salience_and_naming() -> None:
    assert not is_salient(True) and not is_salient("") and not is_salient("l")
    assert not is_salient(1) and not is_salient(0.0)
    assert is_salient("TeamNotes.txt") and is_salient(12446) and is_salient("USR002")
    message = "Meeting notes and project details for the whole team."
    assert is_salient(message) and is_free_text(message) and not is_free_text("USR002")
    assert names(TextIndex("send the project notes and details of the meeting"), message)
    assert not names(TextIndex("send my regards to the whole family"), message)
    index = TextIndex("Book it for December 15, 2026; put 1,500 dollars on report_final.")
    assert names(index, "2026-12-15") and names(index, 1500) and names(index, 1500.0)
    assert names(index, "report_final.txt")  # a file name without its extension
    assert not names(index, "2026-12-16") and not names(index, 150)


def test_a_dropped_call_leaves_a_quoted_name_unused() -> None:
    task = turn(REMOVE)
    kept = [c for c in task.ground_truth[0] if c.name != "rm"]
    corrupted = with_calls(task, kept)
    result = check_description_covered(corrupted, trace_calls(corrupted, bfcl))
    assert not result.passed
    assert "'findings_report'" in result.reasons[0]
    assert check_description_covered(task, trace_calls(task, bfcl)).passed


@pytest.mark.parametrize("backend", ["ngram"])
def test_a_request_about_something_else_fails_the_intent(backend: str) -> None:
    task = turn(CREATE)
    other = with_request(
        task, "Open a new support ticket with priority 4 about my broken laptop screen."
    )
    result = check_intent(other, trace_calls(other, bfcl), backend)  # type: ignore[arg-type]
    assert not result.passed
    assert "not about the functions it calls" in result.reasons[0]
    assert check_intent(task, trace_calls(task, bfcl), backend).passed  # type: ignore[arg-type]


def test_the_intent_is_read_from_the_request_alone() -> None:
    """A description about the call (no policy sees it) and the values the abstractor
    appends do not make a request about something else match its call."""
    asked = "Open a new support ticket with priority 4 about my broken laptop screen."
    task = msgspec.structs.replace(
        with_request(with_calls(turn(DOORS), CLIMATE), f"{asked} {CLIMATE_DETAILS}"),
        description="Adjust the climate control: temperature, unit, fan speed and mode.",
    )
    assert not check_intent(task, trace_calls(task, bfcl), "ngram").passed
    fixed = with_request(
        task, f"Adjust the climate control to 35 degrees celsius, fan speed 12. {CLIMATE_DETAILS}"
    )
    assert check_intent(fixed, trace_calls(fixed, bfcl), "ngram").passed


@pytest.mark.parametrize("placeholder", ["your_username", "YOUR_CLIENT_ID", "<city>", "xxxx"])
def test_a_placeholder_value_is_rejected(placeholder: str) -> None:
    """Run 8 and run 12 accepted tasks whose calls carried a template's blanks."""
    calls = [ToolCall(name="add_to_watchlist", arguments={"stock": placeholder})]
    task = with_request(with_calls(turn(STOCK), calls), f"Add {placeholder} to my watchlist.")
    failed = failed_checks(task)
    assert placeholder in failed["real_values"][0]


def test_no_ground_truth_value_of_bfcl_looks_like_a_placeholder() -> None:
    """Every multi-turn category: the check never rejects a real user's values."""
    categories = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param")
    tasks = [task for category in categories for task in load_tasks(category)]
    assert len(tasks) == 600
    assert [placeholder_values(task) for task in tasks if placeholder_values(task)] == []


def test_no_bfcl_user_turn_speaks_of_the_call_or_the_assistant() -> None:
    """The words that make a request about its task, not a request: no real user turn of
    the four multi-turn categories says them."""
    turns = [
        request
        for category in MULTI_TURN_CATEGORIES
        for task in load_tasks(category)
        for request in task.user_turns
    ]
    assert len(turns) > 2000
    flagged = [t for t in turns if any("speaks of" in f for f in call_syntax(t, []))]
    assert flagged == []
