"""Every LLM role against the real llama.cpp server (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M).

The server comes from the session fixture in conftest.py, started as `coevolve up` starts
it; the roles find it through the environment, as the services do. Prompts are the
services' own, on a real BFCL task and its real function schemas; greedy decoding.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from coevolve.services.abstractor.call_units import CallUnit
from coevolve.services.abstractor.prompts import RequestDraft, request_messages, request_schema
from coevolve.services.explorer.prompts import (
    CONTEXT_SCHEMA,
    exploration_messages,
    summarizer_messages,
    unguided_goal,
)
from coevolve.services.judge.prompts import JUDGE_SCHEMA, Judgment, judge_messages
from coevolve.shared.config import load_settings
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.llm import OpenAIBackend, RoleClients, role_settings
from coevolve.shared.llm.client import ChatMessages, LLMResponse
from coevolve.shared.llm.server import BASE_URL_ENV, LlamaServer, ServerSettings
from coevolve.shared.messages import (
    ChatMessage,
    Exploration,
    ExplorationContext,
    Signal,
    Task,
    ToolCall,
    Trajectory,
)
from coevolve.shared.structured import (
    Rejection,
    RejectionCounter,
    ask_structured,
    function_call_schema,
    tool_names,
)
from coevolve.shared.toolcalls import format_tool_call
from tests.support.messages import CD, NOTES_TASK, TOUCH, untokenized_trajectory
from tests.support.wait import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bfcl() -> tuple[Task, list[dict[str, Any]]]:
    task = next(t for t in seed_tasks() if len(t.user_turns) >= 1)
    environment = make_environment("bfcl")
    environment.reset(task)
    tools = environment.tools()
    environment.close()
    return task, tools


@pytest.fixture
def clients(llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[RoleClients]:
    """Every role on the shared server, found through the environment like a service."""
    for name, value in llama_server.environment().items():
        monkeypatch.setenv(name, value)
    global _runner
    roles = RoleClients(role_settings({"default": {"temperature": 0.0}}))
    # one event loop per test for every call and the teardown: the clients' pooled
    # connections belong to the loop that opened them
    with asyncio.Runner() as runner:
        _runner = runner
        try:
            yield roles
            runner.run(roles.aclose())
        finally:
            _runner = None


_runner: asyncio.Runner | None = None


def run(coroutine: Any) -> Any:
    """Run on the test's event loop (see ``clients``), or on a new one."""
    return _runner.run(coroutine) if _runner is not None else asyncio.run(coroutine)


def ask(
    llm: Any,
    messages: ChatMessages,
    kind: type,
    schema: dict[str, Any],
    max_tokens: int,
    counter: RejectionCounter | None = None,
) -> Any:
    return run(
        ask_structured(
            llm,
            messages,
            kind,
            schema=schema,
            max_tokens=max_tokens,
            temperature=0.0,
            counter=counter,
        )
    )


def short_trajectory(task: Task) -> Trajectory:
    messages = [
        ChatMessage(role="user", content=task.user_turns[0]),
        ChatMessage(role="assistant", content="", tool_calls=[ToolCall(name="ls", arguments={})]),
        ChatMessage(role="tool", content='{"current_directory_content": ["documents"]}'),
        ChatMessage(role="assistant", content="I could not finish the task."),
    ]
    return untokenized_trajectory("traj-1", task.id, messages, policy_version=1)


# --------------------------------------------------------------------------- the roles


def test_summarizer_writes_an_exploration_context(
    clients: RoleClients, bfcl: tuple[Task, list[Any]]
) -> None:
    task, _ = bfcl
    signal = Signal(
        kind="boundary",
        task=task,
        trajectory=short_trajectory(task),
        group_id="g",
        policy_version=1,
        evidence={"successes": 1, "failures": 3, "success_actions": ["ls"]},
    )
    counter = RejectionCounter()
    context = ask(
        clients["summarizer"],
        summarizer_messages(signal),
        ExplorationContext,
        CONTEXT_SCHEMA,
        400,
        counter,
    )
    assert isinstance(context, ExplorationContext), context
    assert context.summary.strip() and context.focus_pattern
    assert counter.accepted == 1


def test_explorer_action_is_a_call_to_an_offered_function(
    clients: RoleClients, bfcl: tuple[Task, list[Any]]
) -> None:
    task, tools = bfcl
    offered = tools[:8]  # a short prompt; the schema still comes from the real functions
    schema = function_call_schema(offered)
    messages = exploration_messages(offered, unguided_goal(task), [], 6)
    call = ask(clients["explorer"], messages, ToolCall, schema, 96)
    assert isinstance(call, ToolCall), call
    assert call.name in tool_names(offered)
    jsonschema.validate({"name": call.name, "arguments": call.arguments}, schema)
    environment = make_environment("bfcl")
    try:
        environment.reset(task)
        result = environment.step(format_tool_call(call))  # the environment takes the call
        assert any(m.role == "tool" for m in result.observations)
    finally:
        environment.close()


def test_abstractor_writes_a_request_for_a_call_unit(
    clients: RoleClients, bfcl: tuple[Task, list[Any]]
) -> None:
    task, tools = bfcl
    observations = ['{"current_working_directory": "documents"}', "None"]
    unit = CallUnit(calls=[CD, TOUCH], observations=observations, changes_state=True)
    exploration = Exploration(id="expl-1", mode="unguided", task=task, rounds=[])
    output = ask(
        clients["abstractor"],
        request_messages(exploration, unit, tools),
        RequestDraft,
        request_schema(),
        300,
    )
    assert isinstance(output, RequestDraft), output
    assert output.description.strip() and output.request.strip()


@pytest.fixture
def judged() -> Task:
    return msgspec.structs.replace(
        NOTES_TASK, id="cand", description="Create notes.txt in documents."
    )


def test_judge_judges_a_candidate(clients: RoleClients, judged: Task) -> None:
    messages = judge_messages(judged, ["documents", "None"], [], self_score=1.0)
    judgment = ask(clients["judge"], messages, Judgment, JUDGE_SCHEMA, 200)
    assert isinstance(judgment, Judgment), judgment
    assert judgment.reason.strip()


# --------------------------------------------------------------------------- bad output


def test_output_cut_by_max_tokens_is_a_counted_rejection(
    clients: RoleClients, judged: Task
) -> None:
    counter = RejectionCounter()
    messages = judge_messages(judged, ["documents", "None"])
    outcome = ask(clients["judge"], messages, Judgment, JUDGE_SCHEMA, 6, counter)
    assert isinstance(outcome, Rejection) and outcome.kind == "truncated", outcome
    assert counter.rejected == {"truncated": 1} and counter.accepted == 0


class SchemaIgnored:
    """An endpoint that ignores ``response_format`` (some do): the model writes freely."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    async def chat(
        self, messages: ChatMessages, *, schema: dict[str, Any] | None = None, **options: Any
    ) -> LLMResponse:
        return await self.llm.chat(messages, **options)


def test_unconstrained_prose_is_a_counted_rejection(clients: RoleClients) -> None:
    counter = RejectionCounter()
    messages = [{"role": "user", "content": "In one sentence, why is the sky blue?"}]
    outcome = ask(SchemaIgnored(clients["judge"]), messages, Judgment, JUDGE_SCHEMA, 40, counter)
    assert isinstance(outcome, Rejection), outcome
    assert outcome.kind in {"invalid_json", "wrong_schema", "truncated"}
    assert counter.total_rejected == 1


# --------------------------------------------------------------------------- a crash


def test_server_killed_mid_request_callers_back_off_and_recover(
    llama_server: LlamaServer, clients: RoleClients, judged: Task
) -> None:
    backends = [clients["judge"].client, OpenAIBackend(clients["judge"].client.settings)]  # type: ignore[attr-defined]
    restarts_before = llama_server.restarts
    messages = judge_messages(judged, ["documents", "None"])

    async def call(backend: Any) -> Any:
        return await ask_structured(
            backend, messages, Judgment, schema=JUDGE_SCHEMA, max_tokens=120, temperature=0.0
        )

    async def scenario() -> list[Any]:
        sent = [b.stats.requests for b in backends]
        calls = [asyncio.create_task(call(b)) for b in backends]
        # both requests on their way: the first is generated, the second waits its turn
        await wait_until(
            lambda: all(b.stats.requests > n for b, n in zip(backends, sent, strict=True)),
            60,
            "both requests sent",
            poll_s=0.05,
        )
        await asyncio.to_thread(llama_server.kill)
        try:
            return await asyncio.gather(*calls)
        finally:
            await backends[1].aclose()

    outcomes = run(scenario())
    assert all(isinstance(o, Judgment) for o in outcomes), outcomes
    assert llama_server.restarts == restarts_before + 1  # the watchdog brought it back
    assert sum(b.stats.retries for b in backends) >= 2  # both callers backed off and retried
    assert llama_server.healthy()


# --------------------------------------------------------------------------- configuration


def test_a_stronger_endpoint_is_one_yaml_entry(
    llama_server: LlamaServer, judged: Task, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge on "another" endpoint: the local server under a second model name,
    reached the way a vLLM or OpenAI endpoint would be, its dialect detected."""
    monkeypatch.delenv(BASE_URL_ENV, raising=False)
    monkeypatch.setenv("STRONG_JUDGE_KEY", llama_server.api_key)
    config = tmp_path / "coevolve.yaml"
    config.write_text(
        "services:\n  llm:\n    roles:\n"
        f"      judge: {{base_url: '{llama_server.base_url}', model: strong-judge, "
        "api_key_env: STRONG_JUDGE_KEY, temperature: 0.0}\n"
    )
    settings = load_settings(config)
    clients = RoleClients.from_section(settings.services["llm"], tmp_path, roles=("judge",))
    backend = clients["judge"].client
    assert isinstance(backend, OpenAIBackend) and backend.dialect is None

    async def go() -> Any:
        try:
            return await ask_structured(
                clients["judge"],
                judge_messages(judged, ["documents", "None"]),
                Judgment,
                schema=JUDGE_SCHEMA,
                max_tokens=200,
                temperature=0.0,
            )
        finally:
            await clients.aclose()

    judgment = run(go())
    assert isinstance(judgment, Judgment), judgment
    assert backend.settings.model == "strong-judge"
    # llama.cpp refused OpenAI's json_schema form; json_object + schema worked and is kept
    assert backend.dialect == "json_object"
    assert clients.own_server.server.process is None  # no second server was started


def test_schema_is_enforced_by_the_server_not_only_checked_after(
    clients: RoleClients, judged: Task
) -> None:
    """A schema the prompt says nothing about still shapes the answer: the grammar."""
    schema = {
        "type": "object",
        "properties": {"verdict": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
        "required": ["verdict", "count"],
        "additionalProperties": False,
    }

    class Odd(msgspec.Struct, forbid_unknown_fields=True):
        verdict: str
        count: int

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    odd = ask(clients["judge"], messages, Odd, schema, 40)
    assert isinstance(odd, Odd) and odd.verdict in {"yes", "no"}, odd


def test_every_role_schema_becomes_a_grammar_without_falling_back(
    llama_server: LlamaServer, bfcl: tuple[Task, list[Any]]
) -> None:
    """llama-cpp-python silently falls back to "any JSON" when it cannot convert a schema;
    the roles' schemas, the real environment's function schemas included, must convert."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    _, tools = bfcl
    schemas = {
        "context": CONTEXT_SCHEMA,
        "action": function_call_schema(tools),
        "request": request_schema(),
        "request with values": request_schema(["AAPL", 210.65, "zip_1"]),
        "judgment": JUDGE_SCHEMA,
    }
    for role, schema in schemas.items():
        grammar = json_schema_to_gbnf(json.dumps(schema))
        assert "root ::=" in grammar, role
    # the request's pattern: its values, and prose that no code character enters
    with_values = json_schema_to_gbnf(json.dumps(schemas["request with values"]))
    assert '[^"\\\\{}=_<>|`:]' in with_values and "[zZ] [iI] [pP] [_]" in with_values
    action = json_schema_to_gbnf(json.dumps(schemas["action"]))
    for name in tool_names(tools):
        assert f'\\"{name}\\"' in action  # each function name is a literal of the grammar


# --------------------------------------------------------------------------- memory


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_server_stays_small_across_distinct_prompts(
    llama_server: LlamaServer, clients: RoleClients
) -> None:
    """Two 30-minute runs had the server OOM-killed at 13.6 GB: every cached prompt state
    copied a (positions x vocabulary) logits buffer that the cache did not count."""
    llm = clients["judge"]
    for topic in ("folders", "stocks", "flights"):
        prompt = f"List ten facts about {topic}. " + " ".join(f"{topic}{n}" for n in range(150))
        messages = [{"role": "user", "content": prompt}]
        response = run(llm.chat(messages, max_tokens=4, temperature=0.0))
        assert isinstance(response, LLMResponse)
    process = llama_server.process
    assert process is not None
    assert resident_mib(process.pid) < 1536


def test_a_key_that_starts_with_a_dash_starts_the_server_and_stays_off_argv(
    tmp_path: Path,
) -> None:
    key = "-" + "k" * 31  # token_urlsafe draws "-" first once in 64 keys
    server = LlamaServer(ServerSettings(n_ctx=512), log_file=tmp_path / "llm.log", api_key=key)
    server.start(watch=False)
    try:
        assert server.healthy()
        assert server.process is not None
        argv = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
        assert key not in argv
    finally:
        server.stop()


def test_abstractor_points_at_the_words_that_name_a_value(clients: RoleClients) -> None:
    # "... include Quasar Ltd.'s stock in my watchlist ...": the parent turn's request names
    # QUAS by its company; the edit puts another symbol in its place
    from coevolve.services.abstractor.edits import NamingWords, naming_spans, span_messages
    from coevolve.services.abstractor.edits import span_schema as words_schema
    from coevolve.shared.envs.bfcl.tasks import load_turn_tasks

    parent = next(t for t in load_turn_tasks() if t.id == "multi_turn_base_113#t0")
    request = parent.user_turns[0]
    output = ask(
        clients["abstractor"],
        span_messages(request, parent.ground_truth[0], "QUAS"),
        NamingWords,
        words_schema(naming_spans(request)),
        40,
    )
    assert isinstance(output, NamingWords), output
    assert output.words == "Quasar Ltd."
