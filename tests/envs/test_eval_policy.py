"""`coevolve eval` with a real policy (SmolLM2 on CPU): slow, excluded by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coevolve.cli.eval_cmd import load_policy_choice, resolve_policy_choice
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl import suite_tasks
from coevolve.shared.evaluation import policy_player, run_suite
from coevolve.shared.messages import Trajectory

pytestmark = pytest.mark.slow


def test_base_policy_plays_eval_entries_end_to_end(tmp_path: Path) -> None:
    from coevolve.shared.policy import SamplingParams, TransformersEngine

    loaded = load_policy_choice(resolve_policy_choice("base", tmp_path), None, tmp_path)
    engine = TransformersEngine(loaded)
    trajectories: list[Trajectory] = []
    steps: list[tuple[int, int, float]] = []
    player = policy_player(
        engine,
        lambda: make_environment("bfcl"),
        SamplingParams(max_new_tokens=24, temperature=0.0, seed=0),
        max_steps_per_turn=1,
        on_trajectory=trajectories.append,
        on_step=lambda step, running, seconds: steps.append((step, running, seconds)),
    )
    tasks = suite_tasks("bfcl-multi-turn-base", "eval")[:3]
    report = run_suite(
        tasks, player, suite="s", split="eval", policy="base", batch_size=2, progress=False
    )
    assert report.n == 3 and 0.0 <= report.accuracy <= 1.0
    assert all(e.error is None and "steps" in e.detail for e in report.entries)
    assert [t.task_id for t in trajectories] == [t.id for t in tasks]
    assert all(sum(t.loss_mask) > 0 for t in trajectories)
    # two batches (2 + 1 entries), each reporting its generation steps in order
    assert steps and [s for s, _, _ in steps if s == 1] == [1, 1]
    assert all(1 <= running <= 2 and seconds > 0 for _, running, seconds in steps)
    json.dumps(report.to_json())


def test_policy_version_loads_exported_weights(tmp_path: Path) -> None:
    from coevolve.shared.policy import export_weights, load_policy

    trained = load_policy(None, run_dir=tmp_path, finetune="lora")
    with torch.no_grad():
        for name, parameter in trained.model.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.01)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "v3.safetensors").write_bytes(export_weights(trained.model))

    choice = resolve_policy_choice("3", tmp_path)
    assert choice.kind == "weights"
    loaded = load_policy_choice(choice, None, tmp_path)
    expected = dict(trained.model.named_parameters())
    for name, parameter in loaded.model.named_parameters():
        if "lora_B" in name:
            assert torch.equal(parameter, expected[name])
