"""The SFT comparison's parts that need no model: supervised runs, the batch order ours
trains, text prompt-completion rows, the timing and the summary of two reports."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

from coevolve.bench import sft
from coevolve.services.learner.sft import IGNORE_INDEX, SftExample, prompt_key


def example(task_id: str, prompt: list[int], *parts: tuple[list[int], bool]) -> SftExample:
    ids, labels = list(prompt), [IGNORE_INDEX] * len(prompt)
    for tokens, supervised in parts:
        ids += tokens
        labels += tokens if supervised else [IGNORE_INDEX] * len(tokens)
    return SftExample(task_id, ids, labels)


def test_segments_are_the_supervised_runs() -> None:
    e = example("t", [1, 2, 3], ([4, 5], True), ([6], False), ([7, 8, 9], True))
    assert sft.segments(e.labels) == [(3, 5), (6, 9)]
    assert sft.segments([IGNORE_INDEX, IGNORE_INDEX]) == []


def test_batches_follow_warm_starts_shuffle_and_prompt_sort() -> None:
    examples = [example(f"t{i}", [i % 3, i], ([9], True)) for i in range(8)]
    batches = sft.batches_in_order(examples, steps=5, batch_size=4, seed=0)

    order = random.Random(0)
    expected = []
    for _ in range(3):  # epochs of 2 batches, as warm_start draws them
        shuffled = list(examples)
        order.shuffle(shuffled)
        for start in (0, 4):
            batch = shuffled[start : start + 4]
            batch.sort(key=prompt_key)
            expected.append(batch)
    assert batches == expected[:5]
    assert all(len(batch) == 4 for batch in batches)


class FakeTokenizer:
    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_text_rows_one_per_example_or_one_per_message() -> None:
    e = example("t", [1, 2], ([3], True), ([4], False), ([5], True))

    whole = sft.text_rows(FakeTokenizer(), e, per_message=False)
    split = sft.text_rows(FakeTokenizer(), e, per_message=True)

    # one row: the observation (4) lands in the completion, so it would carry loss
    assert whole == [{"task_id": "t", "prompt": "<1><2>", "completion": "<3><4><5>"}]
    assert split == [
        {"task_id": "t", "prompt": "<1><2>", "completion": "<3>"},
        {"task_id": "t", "prompt": "<1><2><3><4>", "completion": "<5>"},
    ]


def test_timing_leaves_the_first_step_apart() -> None:
    report = {
        "started": 100.0,
        "step_ends": [130.0, 140.0, 152.0],
        "started_cpu": 5.0,
        "step_cpu_ends": [25.0, 33.0, 41.0],
    }
    assert sft.timing(report) == {
        "steps": 3,
        "s_per_step": 11.0,
        "cpu_s_per_step": 8.0,
        "first_step_s": 30.0,
        "first_step_cpu_s": 20.0,
        "train_s": 52.0,
    }
    assert sft.timing({"started": 0.0, "step_ends": []})["s_per_step"] is None


def report(trainer: str, seconds: list[float], peak: float, loss_tokens: dict[str, int]) -> dict:
    common: dict[str, Any] = {
        "trainer": trainer,
        "dtype": "float32",
        "lora": {"rank": 16},
        "torch_threads": 1,
        "tasks": ["a", "b"],
        "loss_tokens_by_task": {"a": 10, "b": 12},
        "tokens_by_task": {"a": 100, "b": 120},
        "started": 0.0,
        "step_ends": seconds,
        "started_cpu": 0.0,
        "step_cpu_ends": [x / 2 for x in seconds],
        "losses": [1.5, 1.2],
        "peak_reset": True,
        "memory_before_training": {"rss_mb": 500.0, "peak_mb": 600.0},
        "memory_after_training": {"rss_mb": 700.0, "peak_mb": peak},
    }
    if trainer == "trl":
        common["trl_version"] = "1.13.0"
        common["checks"] = {
            "loss_tokens_by_task": loss_tokens,
            "same_input_ids": True,
            "gradient_checkpointing": True,
            "loss_type": "chunked_nll",
            "text_prompt_completion": {
                "one_row_per_example": {
                    "rows": 2,
                    "loss_tokens_by_task": {"a": 30, "b": 40},
                    "tokens_per_epoch": 220,
                    "tokens_are_a_prefix_of_ours": True,
                }
            },
        }
    return common


def test_summary_compares_speed_memory_and_loss_tokens() -> None:
    result = sft.summarize(
        {
            "ours": report("ours", [10.0, 20.0], 900.0, {}),
            "trl": report("trl", [20.0, 40.0], 1800.0, {"a": 10, "b": 12}),
        }
    )

    assert result["trainers"]["ours"]["s_per_step"] == 10.0
    assert result["trainers"]["trl"]["s_per_step"] == 20.0
    assert result["trl_over_ours"] == {"s_per_step": 2.0, "cpu_s_per_step": 2.0, "peak_rss": 2.0}
    assert result["loss_tokens_equal"] is True
    assert result["loss_tokens_per_example"]["trl_text_one_row_per_example"] == [30, 40]
    assert result["trainers"]["ours"]["first_loss"] == 1.5

    unequal = sft.summarize(
        {
            "ours": report("ours", [10.0, 20.0], 900.0, {}),
            "trl": report("trl", [20.0, 40.0], 1800.0, {"a": 11, "b": 12}),
        }
    )
    assert unequal["loss_tokens_equal"] is False


def test_without_trl_it_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a)
    )
    monkeypatch.setenv("COEVOLVE_RUN_DIR", str(tmp_path))

    result = sft.run(quick=True)

    assert "sft-compare" in result["error"]
    assert "sft-compare" in capsys.readouterr().out
    assert not (tmp_path / "bench").exists()
