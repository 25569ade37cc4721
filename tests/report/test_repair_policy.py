"""The measured repair with a real policy (SmolLM2 on CPU, two exported versions, real
BFCL tasks from a real pool file): slow, excluded by default."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from coevolve.report.repair import MEASURED_FILE, NO_SIGNAL, measure_repair, policy_play
from coevolve.report.run_data import load_run
from coevolve.report.run_report import render_run_report
from coevolve.services.pool_store.config import default_seed_classes
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import load_settings
from coevolve.shared.envs.bfcl.tasks import seed_pool
from coevolve.shared.messages import Lineage, Verdict
from tests.support.cache import CACHE_DIR

pytestmark = pytest.mark.slow


def test_measured_repair_plays_two_exported_policy_versions(tmp_path: Path) -> None:
    from coevolve.shared.policy import export_weights, load_policy

    run = tmp_path / "run"
    seeds = seed_pool({"turns": 1.0, "entries": 0.0}, default_seed_classes())[:4]
    parent = seeds[0]
    child = msgspec.structs.replace(
        parent,
        id="child-1",
        user_turns=[parent.user_turns[0] + " Please."],
        origin="synthesized",
        lineage=Lineage(signal_kind="boundary", parent_task_id=parent.id, depth=1),
    )
    with PoolStore(run / "pool.duckdb") as store:
        store.add_tasks(seeds)
        store.record_verdict(Verdict(candidate_id="cand-1", accepted=True, reasons=[], task=child))

    torch.manual_seed(0)
    policy = load_policy(None, run_dir=CACHE_DIR, finetune="lora")
    (run / "policies").mkdir()
    (run / "policies" / "v1.safetensors").write_bytes(export_weights(policy.model))
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.01)
    (run / "policies" / "v2.safetensors").write_bytes(export_weights(policy.model))
    (run / "models").symlink_to(CACHE_DIR / "models", target_is_directory=True)

    settings = load_settings(
        run_dir=str(run),
        services={"rollout": {"max_new_tokens": 16, "max_steps_per_turn": 1}},
    )
    lines: list[str] = []
    out = run / "report" / MEASURED_FILE
    result = measure_repair(
        load_run(run), 2, policy_play(run, settings, "transformers"), out, log=lines.append
    )

    assert (result["first_version"], result["last_version"]) == (1, 2)
    assert result["task_sets"]["boundary"] == [parent.id]
    assert len(result["task_sets"][NO_SIGNAL]) == 1
    assert len(result["samples"]) == 2 * 2 * 2  # 2 tasks x 2 samples x 2 versions
    for sample in result["samples"]:
        assert sample["success"] in (0.0, 1.0)
        assert sample["partial_credit"] is None or 0.0 <= sample["partial_credit"] <= 1.0
    boundary = result["rows"][0]
    assert (boundary["samples_first"], boundary["samples_last"]) == (2, 2)
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert "repair: policy v2: 2 tasks x 2 samples = 4 episodes" in lines
    text = render_run_report(run).read_text()
    assert "each task played 2 times by policy v1 and by v2" in text
