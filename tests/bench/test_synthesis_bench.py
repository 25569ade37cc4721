"""``coevolve bench synthesis`` without a model: recorded explorations through the real
abstractor and judge handlers, a real DuckDB pool and the real BFCL environments, with the
data-loop tests' scripted stand-in (real HTTP on loopback) in every LLM role."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from coevolve.bench import synthesis
from coevolve.bench.local_llm import local_role
from coevolve.cli import app
from coevolve.cli.bench import BENCHMARKS
from coevolve.services.abstractor.config import AbstractorConfig
from coevolve.services.judge.config import JudgeConfig
from coevolve.shared.llm import (
    LlamaServer,
    LLMServerError,
    OpenAIBackend,
    Role,
    RoleClients,
    RoleLLM,
    ServerSettings,
)
from coevolve.shared.llm.model_file import DEFAULT_MODEL, ROLE_MODELS
from coevolve.shared.messages import Exploration, ToolCall
from tests.dataloop.dataloop_harness import WellFormedBrain, logged_exploration
from tests.support.fake_llm import RoleFakeLLM, prompt_text

# n-gram similarity everywhere: no embedding model is loaded
NGRAM = synthesis.Setup(
    abstractor=AbstractorConfig(leak_backend="ngram"),
    judge=JudgeConfig(round_trip=True, llm_judge=True, relevance_backend="ngram"),
)
# names its folder (a request leaving out its call's value is asked for again and dropped
# by the abstractor), and asks for something else
UNRELATED = "Book me a flight from Boston to Denver next Tuesday morning as '{}', economy please."
GOOD = (
    "Please create a new directory called '{}' right here in my current working folder.",
    "I need a folder named '{}' made inside the directory I am in at the moment.",
)


class ScriptedBrain(WellFormedBrain):
    """The abstractor writes for a ``mkdir`` what ``script`` gives for its folder, the
    same on every ask (a rewrite too): ``good`` or ``other_words`` (the folder's creation,
    in words far enough apart that neither is a near copy of the other), ``malformed`` (a
    function's name) or ``unrelated`` (a request about something else); for other calls a
    listing. The round-trip solver creates the folder its request names."""

    def __init__(self, script: dict[str, str]) -> None:
        super().__init__()
        self.script = script

    def abstractor(self, request: dict[str, Any]) -> dict[str, Any]:
        folder = re.search(r'dir_name = "([^"]+)"', prompt_text(request))
        if folder is None:  # calls of another kind (the committed explorations)
            return {"description": "A listing.", "request": "Please list my current folder."}
        kind = self.script.get(folder.group(1), "good")
        if kind == "malformed":
            return {"description": "A function name.", "request": "mkdir"}
        if kind == "unrelated":
            return {"description": "A flight.", "request": UNRELATED.format(folder.group(1))}
        text = (GOOD[1] if kind == "other_words" else GOOD[0]).format(folder.group(1))
        return {"description": "Create a folder in the current directory.", "request": text}

    def explorer(self, request: dict[str, Any]) -> dict[str, Any]:
        # the round-trip solver's plan (the stand-in tells roles apart by schema)
        schema = request["response_format"]["json_schema"]["schema"]
        assert "calls" in schema["properties"], "only the round trip asks for calls here"
        asked = prompt_text(request).rsplit("Request:", 1)[1]
        folder = re.search(r"'([^']+)'", asked)
        name = folder.group(1) if folder else "nothing"
        return {"calls": [{"name": "mkdir", "arguments": {"dir_name": name}}]}


def mkdir(name: str) -> ToolCall:
    return ToolCall(name="mkdir", arguments={"dir_name": name})


def explorations_file(path: Path, folders: list[list[str]]) -> Path:
    """A record file with one logged exploration per entry of ``folders``, a round per
    folder (each round one ``mkdir``), as the explorer records them."""
    lines = []
    for number, rounds in enumerate(folders):
        explored = logged_exploration([[(mkdir(name), True)] for name in rounds])
        explored = msgspec.structs.replace(explored, id=f"expl-logged-{number}")
        lines.append(msgspec.json.encode(explored))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture
def fake() -> Iterator[RoleFakeLLM]:
    script = {"beta": "malformed", "gamma": "unrelated", "delta": "other_words"}
    server = RoleFakeLLM(ScriptedBrain(script)).start()
    try:
        yield server
    finally:
        server.stop()


def scripted(fake: RoleFakeLLM, served: list[str]) -> synthesis.Serve:
    """The benchmark's ``serve`` with every role on ``fake``; the models asked for go in
    ``served``."""

    @asynccontextmanager
    async def serve(model: str, run_dir: Path) -> AsyncIterator[dict[Role, RoleLLM]]:
        served.append(model)
        clients = RoleClients.from_section(fake.llm_section(), run_dir)
        try:
            yield {role: clients[role] for role in synthesis.SERVED_ROLES}
        finally:
            await clients.aclose()

    return serve


def test_the_committed_inputs_decode_into_16_explorations() -> None:
    explorations = synthesis.load_explorations(synthesis.ROOT / synthesis.INPUTS)
    assert len(explorations) == 16
    assert all(isinstance(e, Exploration) and e.rounds for e in explorations)
    assert len({e.id for e in explorations}) == 16
    assert len(synthesis.load_explorations(synthesis.ROOT / synthesis.INPUTS, 4)) == 4


def test_explorations_become_candidates_and_the_judge_sorts_them(
    tmp_path: Path, fake: RoleFakeLLM
) -> None:
    inputs = explorations_file(
        tmp_path / "explorations.jsonl", [["alpha", "beta"], ["gamma", "delta"]]
    )
    served: list[str] = []
    report = synthesis.run(
        quick=True,
        serve=scripted(fake, served),
        setup=NGRAM,
        inputs=inputs,
        base_run_dir=tmp_path,
        models=[DEFAULT_MODEL.alias],
    )

    assert served == [DEFAULT_MODEL.alias] and list(report["models"]) == served
    row = report["models"][DEFAULT_MODEL.alias]
    assert "error" not in row
    assert (row["explorations"], row["call_units"], row["candidates"]) == (2, 4, 3)
    assert row["abstractor_rejections"] == {"malformed_request": 1}
    # the unrelated request is stopped by the deterministic checks, before any LLM stage
    assert (row["passed_checks"], row["round_trip_pass"], row["accepted"]) == (2, 2, 2)
    assert row["judge_outcomes"] == {"accepted": 2, "rejected_by_checks": 1}
    assert row["judge_unusable_outputs"] == {}
    assert row["judge_rejections"] and "round_trip" not in row["judge_rejections"]
    accepted = {task["request"]: task["calls"] for task in row["accepted_tasks"]}
    assert accepted == {
        GOOD[0].format("alpha"): ['mkdir({"dir_name": "alpha"})'],
        GOOD[1].format("delta"): ['mkdir({"dir_name": "delta"})'],
    }
    assert row["s_per_candidate"] == pytest.approx(row["seconds"] / 3, abs=0.01)
    # a malformed request may be asked for again before it is dropped
    assert fake.calls["abstractor"] >= 4
    assert (fake.calls["explorer"], fake.calls["judge"]) == (2, 2)
    assert report["inputs"] == {
        "path": str(inputs),
        "sha256": hashlib.sha256(inputs.read_bytes()).hexdigest(),
        "explorations": 2,
    }
    assert set(report["cpu"]) == {"model", "avx512_bf16"}
    assert report["threads"] >= 1
    assert (Path(report["run_dir"]) / "pool.duckdb").is_file()


def test_quick_takes_the_first_four_committed_explorations(
    tmp_path: Path, fake: RoleFakeLLM
) -> None:
    served: list[str] = []
    report = synthesis.run(
        quick=True, serve=scripted(fake, served), setup=NGRAM, base_run_dir=tmp_path
    )
    assert served == list(ROLE_MODELS)  # --quick still compares every model
    committed = (synthesis.ROOT / synthesis.INPUTS).read_bytes()
    assert report["inputs"]["path"] == str(synthesis.INPUTS)
    assert report["inputs"]["sha256"] == hashlib.sha256(committed).hexdigest()
    row = report["models"][DEFAULT_MODEL.alias]
    assert row["explorations"] == 4 and row["call_units"] >= 1
    assert row["accepted"] <= row["passed_checks"] <= row["candidates"] <= row["call_units"]
    rejected = sum(row["judge_outcomes"].values()) - row["accepted"]
    assert (rejected > 0) == bool(row["judge_rejections"])


def test_a_model_whose_server_cannot_start_is_reported_and_the_next_runs(
    tmp_path: Path,
) -> None:
    served: list[str] = []

    @asynccontextmanager
    async def broken(model: str, run_dir: Path) -> AsyncIterator[dict[Role, RoleLLM]]:
        served.append(model)
        raise LLMServerError(f"model part 1 of 22 is missing for {model}")
        yield {}

    inputs = explorations_file(tmp_path / "explorations.jsonl", [["alpha"]])
    report = synthesis.run(
        quick=False, serve=broken, setup=NGRAM, inputs=inputs, base_run_dir=tmp_path
    )
    assert served == list(ROLE_MODELS) == list(report["models"])
    for row in report["models"].values():
        assert row["error"].startswith("the LLM server did not start: model part 1")


def test_an_llm_that_stops_answering_ends_the_pass_with_what_was_done(tmp_path: Path) -> None:
    gone = RoleFakeLLM(ScriptedBrain({}))  # never started: nothing listens on its port
    inputs = explorations_file(tmp_path / "explorations.jsonl", [["alpha"]])
    report = synthesis.run(
        quick=True, serve=scripted(gone, []), setup=NGRAM, inputs=inputs, base_run_dir=tmp_path
    )
    row = report["models"][DEFAULT_MODEL.alias]
    assert row["error"].startswith("the LLM became unavailable")
    assert (row["explorations"], row["candidates"], row["s_per_candidate"]) == (0, 0, None)


def test_local_role_points_a_role_at_the_server_with_its_settings() -> None:
    server = LlamaServer(ServerSettings(model="qwen2.5-coder-1.5b-instruct", port=8123))
    abstractor = local_role(server, "abstractor")
    judge = local_role(server, "judge", {"default": {"temperature": 0.0}})
    try:
        assert isinstance(abstractor.client, OpenAIBackend)
        assert abstractor.client.settings.base_url == server.base_url
        assert abstractor.client.settings.model == "qwen2.5-coder-1.5b-instruct"
        assert (abstractor.role, judge.role) == ("abstractor", "judge")
        assert (abstractor.settings.temperature, judge.settings.temperature) == (0.7, 0.0)
    finally:
        for llm in (abstractor, judge):
            asyncio.run(llm.client.aclose())


def test_the_benchmark_is_registered_and_runs_every_judge_stage() -> None:
    assert "synthesis" in BENCHMARKS
    assert synthesis.Setup().judge.round_trip and not synthesis.Setup().judge.llm_judge


def test_cli_takes_recorded_inputs_and_refuses_an_unknown_model(tmp_path: Path) -> None:
    inputs = explorations_file(tmp_path / "explorations.jsonl", [["alpha", "beta"]])
    unknown = CliRunner().invoke(
        app, ["bench", "synthesis", "--inputs", str(inputs), "--models", "gpt-9"]
    )
    assert (
        unknown.exit_code != 0 and "--models takes: qwen2.5-coder-0.5b-instruct" in unknown.output
    )
    missing = CliRunner().invoke(app, ["bench", "synthesis", "--inputs", str(tmp_path / "no")])
    assert missing.exit_code != 0
    assert "does not exist" in " ".join(missing.output.replace("│", " ").split())
    elsewhere = CliRunner().invoke(app, ["bench", "dataloop", "--inputs", str(inputs)])
    assert elsewhere.exit_code != 0 and "does not take --inputs" in elsewhere.output
