"""The in-process backend with the real SmolLM2-135M and xgrammar-constrained decoding.

The GGUF file is converted once into ``runs/test-cache`` (shared with the other model
tests); later loads read safetensors.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import pytest

from coevolve.services.explorer.prompts import (
    CONTEXT_SCHEMA,
    exploration_messages,
    summarizer_messages,
    unguided_goal,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import LLMResponse, LocalBackend
from coevolve.shared.messages import (
    ChatMessage,
    ExplorationContext,
    Signal,
    Task,
    ToolCall,
    Trajectory,
)
from coevolve.shared.structured import (
    RejectionCounter,
    ask_structured,
    function_call_schema,
    parse_structured,
)

CACHE_DIR = Path(
    os.environ.get("COEVOLVE_TEST_CACHE", Path(__file__).resolve().parents[2] / "runs/test-cache")
)


class City(msgspec.Struct, forbid_unknown_fields=True):
    population: int
    city: str


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        # Not in alphabetical order: the grammar must keep the schema's order.
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
    },
    "required": ["population", "city"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Name a city and its population, as JSON."}]


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    return LocalBackend(device="cpu", run_dir=CACHE_DIR)


def test_constrained_json_parses_and_loop_stays_free(backend: LocalBackend) -> None:
    """The output decodes as ``City``; while the model generates in its worker thread,
    the event loop keeps running other coroutines."""

    async def go() -> tuple[object, LLMResponse, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        response = await backend.chat(QUESTION, schema=CITY_SCHEMA, max_tokens=32, temperature=0.0)
        done.set()
        await ticking
        outcome = parse_structured(response.text, City, finish_reason=response.finish_reason)
        return outcome, response, ticks

    started = time.monotonic()
    outcome, response, ticks = asyncio.run(go())
    elapsed = time.monotonic() - started
    assert isinstance(outcome, City), outcome
    assert response.finish_reason == "stop"
    assert response.text.startswith('{"population":')  # compact, in the schema's order
    assert 0 <= outcome.population <= 99999999 and 1 <= len(outcome.city) <= 16
    # A blocked loop would tick a handful of times; a free one ~100 times per second.
    assert ticks > 10 * elapsed


@pytest.mark.slow
def test_sampled_constrained_outputs_all_parse(backend: LocalBackend) -> None:
    async def go() -> RejectionCounter:
        counter = RejectionCounter()
        for _ in range(6):
            await ask_structured(
                backend,
                QUESTION,
                City,
                schema=CITY_SCHEMA,
                max_tokens=40,
                temperature=1.0,
                counter=counter,
            )
        return counter

    counter = asyncio.run(go())
    assert counter.accepted == 6, counter.snapshot()


def test_output_cut_by_max_tokens_is_reported_as_length(backend: LocalBackend) -> None:
    response = asyncio.run(
        backend.chat(QUESTION, schema=CITY_SCHEMA, max_tokens=3, temperature=0.0)
    )
    assert response.finish_reason == "length" and response.completion_tokens == 3
    outcome = parse_structured(response.text, City, finish_reason=response.finish_reason)
    assert getattr(outcome, "kind", None) == "truncated"


@pytest.mark.slow
def test_summarizer_context_from_the_local_model(backend: LocalBackend) -> None:
    """The real summarizer prompt and schema: the output is an ExplorationContext, or, if
    the token budget cuts it, a counted "truncated" rejection; never anything else."""
    task = Task(
        id="t1",
        environment="bfcl",
        user_turns=["Move report.txt into the archive folder."],
    )
    trajectory = Trajectory(
        id="traj",
        task_id="t1",
        messages=[
            ChatMessage(role="user", content=task.user_turns[0]),
            ChatMessage(
                role="assistant",
                content="",
                tool_calls=[
                    ToolCall(
                        name="mv",
                        arguments={"source": "report.txt", "destination": "archive/report.txt"},
                    )
                ],
            ),
            ChatMessage(
                role="tool", content="Error: destination must be a name in the current directory"
            ),
            ChatMessage(role="assistant", content="I moved the file."),
        ],
        token_ids=[],
        logprobs=[],
        loss_mask=[],
        reward=0.0,
        policy_version=1,
    )
    signal = Signal(
        kind="boundary",
        task=task,
        trajectory=trajectory,
        group_id="g",
        policy_version=1,
        evidence={"successes": 2, "failures": 6, "success_actions": ["mv"]},
    )
    counter = RejectionCounter()
    outcome = asyncio.run(
        ask_structured(
            backend,
            summarizer_messages(signal),
            ExplorationContext,
            schema=CONTEXT_SCHEMA,
            max_tokens=400,
            temperature=0.0,
            counter=counter,
        )
    )
    if isinstance(outcome, ExplorationContext):
        assert outcome.summary and outcome.focus_pattern
        assert counter.accepted == 1
    else:
        assert counter.rejected == {"truncated": 1}, outcome


@pytest.mark.slow
def test_explorer_actions_are_valid_calls_in_a_real_bfcl_environment(
    backend: LocalBackend,
) -> None:
    """Constrained to the environment's function schemas, even the 135M model only
    produces calls to existing functions with their required arguments."""
    task = seed_tasks()[0]
    environment = make_environment("bfcl")
    environment.reset(task)
    tools = environment.tools()
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    steps: list[tuple[str, str]] = []
    for _ in range(2):
        messages = exploration_messages(tools, unguided_goal(task), steps)
        response = backend.generate(messages, function_call_schema(tools), 64, 0.7)
        call = parse_structured(response.text, ToolCall, finish_reason=response.finish_reason)
        assert isinstance(call, ToolCall), call
        assert call.name in parameters
        spec = parameters[call.name]
        assert set(spec.get("required", [])) <= set(call.arguments)
        assert set(call.arguments) <= set(spec.get("properties", {}))
        _, observation = environment.execute(call)
        steps.append((response.text, observation))
    environment.close()
