"""The CUDA path: rollout engine and learner on one GPU, with the contracts the CPU path keeps.

Skipped where torch sees no GPU. ``COEVOLVE_GPU_TEST_MODEL`` names the model directory to
load (default: the shipped policy); ``COEVOLVE_GPU_TEST_REPORT`` a JSON file for the
timings measured on the way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.demonstrations import IGNORE_INDEX, SftExample
from coevolve.shared.messages import ChatMessage, RolloutGroup, Trajectory
from coevolve.shared.policy import (
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    import_weights,
    load_policy,
)
from coevolve.shared.policy.chat import render_prompt_ids
from coevolve.shared.policy.logprobs import sequence_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
GROUP = 8
NEW_TOKENS = 48
# bf16 layers with a float32 head, as on CPU (tests/policy/test_dtype.py)
BF16_MEAN_TOLERANCE = 0.05
REPORT: dict[str, Any] = {}


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_policy() -> LoadedPolicy:
    model = os.environ.get("COEVOLVE_GPU_TEST_MODEL")
    policy = load_policy(model, device=DEVICE, dtype="auto")
    assert policy.model.device.type == DEVICE
    assert policy.extra["dtype"] == "bfloat16"
    return policy


def sampled_group(policy: LoadedPolicy, rewards: list[float]) -> RolloutGroup:
    messages = [ChatMessage(role="user", content="List the files in the current folder.")]
    prompt = render_prompt_ids(policy.tokenizer, messages, None)
    engine = TransformersEngine(policy, stop_tokens={-1})  # every row runs the full budget
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)
    synchronize()
    started = time.perf_counter()
    generations = engine.generate([prompt] * len(rewards), params)
    synchronize()
    seconds = time.perf_counter() - started
    REPORT["group_tokens_per_s"] = sum(len(g.completion_ids) for g in generations) / seconds
    trajectories = [
        Trajectory(
            id=f"t{i}",
            task_id="files",
            messages=messages,
            token_ids=prompt + g.completion_ids,
            logprobs=[0.0] * len(prompt) + g.logprobs,
            loss_mask=[0] * len(prompt) + [1] * len(g.completion_ids),
            reward=reward,
            policy_version=0,
            temperature=g.temperature,
        )
        for i, (g, reward) in enumerate(zip(generations, rewards, strict=True))
    ]
    return RolloutGroup(task_id="files", origin="seed", policy_version=0, trajectories=trajectories)


def rescored(policy: LoadedPolicy, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([trajectory.token_ids], device=DEVICE)
    mask = torch.tensor([trajectory.loss_mask], dtype=torch.bool, device=DEVICE)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(
            policy.model, ids, torch.ones_like(ids), 1.0, positions=mask
        )
    behaviour = torch.tensor([trajectory.logprobs], device=DEVICE)
    return logprobs[mask].float(), behaviour[mask]


def test_engine_behaviour_logprobs_match_the_learners_on_cuda() -> None:
    policy = cuda_policy()
    group = sampled_group(policy, [1.0, 0.0] * (GROUP // 2))
    gaps = [(a - b).abs() for a, b in (rescored(policy, t) for t in group.trajectories)]
    mean_gap = float(torch.cat(gaps).mean())
    REPORT["logprob_abs_diff_mean"] = mean_gap
    assert mean_gap < BF16_MEAN_TOLERANCE


def test_a_grpo_step_on_cuda_trains_and_exports_weights_rollout_loads_identically() -> None:
    policy = cuda_policy()
    group = sampled_group(policy, [1.0, 0.0] * (GROUP // 2))
    tokenize = policy.tokenizer
    prompt = tokenize("The answer is", add_special_tokens=False)["input_ids"]
    target = tokenize(" forty-two", add_special_tokens=False)["input_ids"]
    demo = SftExample("demo", prompt + target, [IGNORE_INDEX] * len(prompt) + target)
    learner = GrpoLearner(policy, LearnerConfig(lr=1e-3, demo_examples=1))
    learner.set_demonstrations([demo])
    before = rescored(policy, group.trajectories[0])[0].sum()
    learner.step([group])  # the first step pays CUDA's start-up costs
    synchronize()
    started = time.perf_counter()
    metrics = learner.step([group])
    synchronize()
    REPORT["grpo_step_s"] = time.perf_counter() - started
    REPORT["grpo_tokens_per_s"] = metrics.tokens_per_s
    assert metrics.trained and metrics.version == 2 and metrics.demo_loss > 0
    assert torch.isfinite(torch.tensor([metrics.loss, metrics.grad_norm])).all()
    assert not torch.isclose(rescored(policy, group.trajectories[0])[0].sum(), before)

    rollout = cuda_policy()  # a rollout worker's copy, loading the published weights
    import_weights(rollout.model, learner.export_weights())
    ids = torch.tensor([group.trajectories[0].token_ids], device=DEVICE)
    with torch.no_grad():
        trained = policy.model(input_ids=ids).logits
        loaded = rollout.model(input_ids=ids).logits
    assert torch.equal(trained, loaded)


def test_zz_write_report() -> None:
    path = os.environ.get("COEVOLVE_GPU_TEST_REPORT")
    if not path:
        pytest.skip("COEVOLVE_GPU_TEST_REPORT not set")
    REPORT["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    REPORT["torch"] = torch.__version__
    Path(path).write_text(json.dumps(REPORT, indent=2))
    assert {"group_tokens_per_s", "grpo_step_s"} <= REPORT.keys()
