"""The held-out eval's per-task measures: success, partial credit and the ground truth's
log-likelihood, on real BFCL turns with the real policy and tokenizer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from coevolve.services.learner.sft import warm_start
from coevolve.shared.demonstrations import (
    replayed_conversation,
    target_token_counts,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.evaluation import ground_truth_scorer, policy_player, run_suite
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.policy import LoadedPolicy, SamplingParams, TransformersEngine
from coevolve.shared.policy.factory import engine_for_policy
from coevolve.shared.toolcalls import format_tool_calls
from tests.policy.conftest import PolicyFactory, randomize_adapters
from tests.policy.test_episodes import ScriptedPolicy


def bfcl() -> Any:
    return make_environment("bfcl")


@pytest.fixture(scope="module")
def two_call_turn() -> Task:
    """A held-out turn whose ground truth is two calls."""
    return next(t for t in suite_tasks("bfcl-turns-base", "eval") if len(t.ground_truth[0]) == 2)


def play(engine: Any, task: Task, texts: list[str]) -> Any:
    scripted = ScriptedPolicy(engine, texts)
    player = policy_player(scripted, bfcl, SamplingParams(max_new_tokens=128), 4)
    return run_suite(
        [task], player, suite="s", split="eval", policy="p", batch_size=1, progress=False
    )


def test_the_ground_truth_one_call_a_message_succeeds_with_full_credit(
    engine: TransformersEngine, two_call_turn: Task
) -> None:
    texts = [format_tool_calls([c]) for c in two_call_turn.ground_truth[0]] + ["Done."]
    report = play(engine, two_call_turn, texts)
    [entry] = report.entries
    assert entry.score == 1.0 and entry.partial_credit == 1.0
    assert report.summary()["partial_credit_mean"] == 1.0


def test_a_wrong_argument_fails_with_partial_credit(
    engine: TransformersEngine, two_call_turn: Task
) -> None:
    first, second = two_call_turn.ground_truth[0]
    wrong = ToolCall(name=second.name, arguments={k: "zzz" for k in second.arguments})
    texts = [format_tool_calls([first]), format_tool_calls([wrong]), "Done."]
    report = play(engine, two_call_turn, texts)
    [entry] = report.entries
    assert entry.score == 0.0
    assert entry.partial_credit == pytest.approx(0.75)  # one exact (1) + one by name (0.5)
    summary = report.summary()
    assert summary["success"] == 0.0 and summary["s_per_task"] > 0


def test_a_turn_never_closed_is_cut_at_the_budget_and_scores_zero(
    engine: TransformersEngine, two_call_turn: Task
) -> None:
    call = format_tool_calls([two_call_turn.ground_truth[0][0]])
    scripted = ScriptedPolicy(engine, [call] * 10)
    player = policy_player(scripted, bfcl, SamplingParams(max_new_tokens=128), 4)
    report = run_suite(
        [two_call_turn], player, suite="s", split="eval", policy="p", batch_size=1, progress=False
    )
    assert len(scripted.prompts) == 4 and report.entries[0].score == 0.0


def test_the_likelihood_scores_the_calls_and_rises_when_the_policy_learns_them(
    make_policy: PolicyFactory, two_call_turn: Task
) -> None:
    policy: LoadedPolicy = make_policy()
    scorer = ground_truth_scorer(policy, bfcl)
    env = bfcl()
    conversation = replayed_conversation(two_call_turn, env)
    env.close()
    call_tokens = sum(target_token_counts(policy.tokenizer, conversation)[:2])

    [(before, tokens)] = scorer([two_call_turn])
    assert tokens == call_tokens  # the two calls with their end tokens; not the closing
    assert math.isfinite(before) and before < 0

    warm_start(policy, [two_call_turn], epochs=3, lr=2e-3, batch_size=1)
    policy.model.train()
    [(after, again)] = scorer([two_call_turn])
    assert again == tokens and after > before + 0.5
    assert policy.model.training  # scored in eval mode, then the mode is given back

    nothing = Task(
        id="empty",
        environment="bfcl",
        user_turns=["hi"],
        ground_truth=[[]],
        env_config=two_call_turn.env_config,
        initial_state=two_call_turn.initial_state,
    )
    assert scorer([nothing]) == [None]


def test_the_llama_cpp_engine_scores_the_ground_truth_as_the_torch_policy_does(
    make_policy: PolicyFactory, cache_dir: Path
) -> None:
    """The eval scores a batch's ground truths on its llama.cpp engine, prefixes shared."""
    policy: LoadedPolicy = make_policy()
    randomize_adapters(policy, seed=5)
    engine = engine_for_policy(
        "llama_cpp", policy, run_dir=cache_dir, threads=1, sequences=4, kv_layout="per_sequence"
    )
    tasks = suite_tasks("bfcl-turns-base", "eval")[:2]  # two turns of one entry share a prefix
    try:
        by_llama = ground_truth_scorer(policy, bfcl, engine.token_logprobs)(tasks)
        shared = engine.stats.prefix_prefilled_tokens
    finally:
        engine.close()
    by_torch = ground_truth_scorer(policy, bfcl)(tasks)
    assert shared > 0
    for ours, theirs in zip(by_llama, by_torch, strict=True):
        assert ours is not None and theirs is not None
        assert ours[1] == theirs[1]
        assert ours[0] == pytest.approx(theirs[0], abs=0.02)  # f16 base against float32
