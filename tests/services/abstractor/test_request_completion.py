"""The abstractor completes a drafted request with the argument values it leaves out."""

from __future__ import annotations

from functools import cache

import msgspec

from coevolve.services.abstractor.completion import complete_requests
from coevolve.services.judge.checks import check_arguments_named, trace_calls
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.messages import Task, ToolCall

# "... create a document titled 'TeamNotes.txt' ..." -> cd(documents), touch(TeamNotes.txt)
CREATE = "multi_turn_base_2#t0"
# the root holds one folder, 'SuperResearch'
REMOVE = "multi_turn_base_38#t0"


@cache
def _train_turns() -> dict[str, Task]:
    return {task.id: task for task in suite_tasks("bfcl-turns-base", "train")}


def turn(task_id: str, request: str, calls: list[ToolCall] | None = None) -> Task:
    task = _train_turns()[task_id]
    return msgspec.structs.replace(
        task, user_turns=[request], ground_truth=[calls or list(task.ground_truth[0])]
    )


def bfcl() -> Environment:
    return make_environment("bfcl")


def test_a_vague_request_gets_the_values_and_then_passes_the_judges_check() -> None:
    vague = turn(CREATE, "Make me a notes file, please.")
    assert not check_arguments_named(vague, trace_calls(vague, bfcl)).passed

    completed, added = complete_requests(vague)
    assert added == 2
    assert completed.user_turns == [
        "Make me a notes file, please. Details: folder 'documents'; file name 'TeamNotes.txt'."
    ]
    assert completed.ground_truth == vague.ground_truth
    assert check_arguments_named(completed, trace_calls(completed, bfcl)).passed


def test_values_already_written_or_returned_earlier_are_not_added() -> None:
    written = turn(CREATE, "In documents, create the file TeamNotes.txt for me.")
    assert complete_requests(written) == (written, 0)

    calls = [ToolCall(name="ls"), ToolCall(name="cd", arguments={"folder": "SuperResearch"})]
    listed = turn(REMOVE, "See what is in this folder, then go into the folder there.", calls)
    assert complete_requests(listed) == (listed, 0)  # ls's result shows 'SuperResearch'
    unlisted = turn(REMOVE, "Go into the folder there.", calls[1:])
    assert complete_requests(unlisted)[1] == 1
