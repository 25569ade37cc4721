"""A run with no labels: start states without questions or answers, the D0 file, the pool
seeded from D0 alone, and the warm start imitating D0's calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from coevolve.schedules.discovery import build_llm_section
from coevolve.services.explorer.discovery import calls_of
from coevolve.services.explorer.prompts import COVERED_NOTE, unguided_goal
from coevolve.services.learner.config import WarmStartConfig
from coevolve.services.learner.warm_start import demonstration_origin, warm_start_tasks
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.handler import seed_tasks_for, unlabelled_seed
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import ConfigError, Settings, load_settings
from coevolve.shared.envs import make_environment, start_tasks
from coevolve.shared.envs.bfcl.tasks import labelled_turns, seed_tasks
from coevolve.shared.messages import ExplorationRequest
from coevolve.shared.task_sets import D0Error, load_d0, split_heldout, write_d0
from tests.nolabels.conftest import carries_labels


def d0_settings(tmp_path: Path, d0_file: Path) -> Settings:
    settings = load_settings(run_dir=str(tmp_path / "run"))
    settings.labels = "none"
    settings.d0.file = str(d0_file)
    return settings


def test_start_states_hold_no_question_and_no_answer() -> None:
    starts = start_tasks("bfcl")
    assert len(starts) >= 30
    turns = [t for t in labelled_turns() if len(t) >= 30]
    environment = make_environment("bfcl")
    for start in starts:
        assert start.user_turns == [] and start.ground_truth == []
        assert not {"prior_turns", "prior_ground_truth"} & set(start.env_config)
        goal = unguided_goal(start).lower()
        assert not [turn for turn in turns if turn in goal], start.id
    assert environment.reset(starts[0]) == []  # nothing to answer, only a state
    assert environment.tools()
    environment.close()


def test_d0_file_is_refused_when_missing_edited_or_unusable(
    tmp_path: Path, committed_d0: Path
) -> None:
    with pytest.raises(D0Error, match="coevolve discover"):
        load_d0(tmp_path / "none.json")
    d0 = load_d0(committed_d0)
    path = tmp_path / "d0.json"
    write_d0(path, d0)
    assert load_d0(path).sha256 == d0.sha256
    with pytest.raises(D0Error, match="expected"):
        load_d0(path, sha256="0" * 64)
    edited = path.read_text().replace(d0.tasks[0].user_turns[0], "Do something else.", 1)
    path.write_text(edited)
    with pytest.raises(D0Error, match="sha256"):
        load_d0(path)
    d0.tasks[0].ground_truth = [[]]
    write_d0(path, d0)
    with pytest.raises(D0Error, match="without a request or calls"):
        load_d0(path)


def test_d0_holds_out_one_discovered_task_in_n_and_guards_them_too(
    tmp_path: Path, committed_d0: Path
) -> None:
    d0 = load_d0(committed_d0)
    training, heldout = split_heldout(d0.tasks[:11], 5)
    assert heldout == [d0.tasks[0], d0.tasks[5], d0.tasks[10]]  # the first one first
    assert training == [t for i, t in enumerate(d0.tasks[:11]) if i not in (0, 5, 10)]
    assert split_heldout(d0.tasks[:3], 0) == (d0.tasks[:3], [])
    bfcl = load_settings(run_dir=str(tmp_path), d0={"environment": "bfcl"})
    assert bfcl.d0.keeps_heldout_every == 0
    shop = load_settings(run_dir=str(tmp_path), d0={"environment": "shop"})
    assert shop.d0.keeps_heldout_every == 5
    with pytest.raises(ConfigError, match="heldout_every"):
        load_settings(run_dir=str(tmp_path), d0={"heldout_every": -1})

    d0.tasks, d0.heldout = training, heldout
    path = tmp_path / "d0.json"
    write_d0(path, d0)
    assert load_d0(path).heldout == heldout
    assert load_d0(path).sha256 != load_d0(committed_d0).sha256
    path.write_text(path.read_text().replace(heldout[0].user_turns[0], "Something else.", 1))
    with pytest.raises(D0Error, match="sha256"):  # an edited held-out task is refused too
        load_d0(path)


def test_committed_d0_was_discovered_and_carries_no_label(committed_d0: Path) -> None:
    d0 = load_d0(committed_d0)
    assert d0.environment == "bfcl" and d0.role_model and d0.code_version
    assert len(d0.tasks) >= 12 and d0.build.explorations >= len(d0.tasks) / 3
    for task in d0.tasks:
        assert task.origin == "explored" and task.lineage.exploration_mode == "unguided"
        assert task.lineage.parent_task_id.endswith("#state")
        assert carries_labels(task) == [], task.id


def test_a_d0_task_asking_a_bfcl_question_is_left_out(tmp_path: Path, committed_d0: Path) -> None:
    d0 = load_d0(committed_d0)
    question = seed_tasks()[0].user_turns[0]
    d0.tasks[0] = msgspec.structs.replace(d0.tasks[0], user_turns=[f"  {question.upper()} "])
    write_d0(tmp_path / "d0.json", d0)
    kept = unlabelled_seed(tmp_path / "d0.json")
    assert [t.id for t in kept] == [t.id for t in d0.tasks[1:]]
    with pytest.raises(ConfigError, match="labels: none"):
        unlabelled_seed(tmp_path / "missing.json")


def test_pool_store_seeds_d0_alone_and_refuses_a_labelled_pool(
    tmp_path: Path, committed_d0: Path
) -> None:
    settings = d0_settings(tmp_path, committed_d0)
    actor = PoolStoreActor(settings)
    anyio.run(actor.setup)
    assert actor.store is not None
    pool = actor.store.sample_batch(1000, mix={"explored": 1.0}, seed=0)
    stats = actor.store.stats()
    anyio.run(actor.teardown)
    d0 = load_d0(committed_d0)
    assert {k: n for k, n in stats.tasks_by_origin.items() if n} == {"explored": len(d0.tasks)}
    assert {t.id for t in pool} == {t.id for t in d0.tasks}
    assert all(carries_labels(task) == [] for task in pool)
    # D0 is the run's seed set: the explorer (max_parent_depth 0) explores its signals
    assert all(task.lineage.depth == 0 for task in pool)
    # the warm start and the replay imitate D0's validated calls
    origin = demonstration_origin(settings.labels)
    chosen = warm_start_tasks(pool, WarmStartConfig(tasks=8))
    assert origin == "explored" and len(chosen) == 8
    assert {t.id for t in chosen} <= {t.id for t in d0.tasks}

    labelled = tmp_path / "labelled"
    with PoolStore(labelled / "pool.duckdb") as store:
        store.add_tasks(seed_tasks_for("bfcl")[:3])
    refused = PoolStoreActor(d0_settings(labelled.parent / "x", committed_d0))
    refused.settings.run_dir = labelled
    with pytest.raises(ConfigError, match="3 labelled tasks"):
        anyio.run(refused.setup)
    anyio.run(refused.teardown)


def test_labels_setting_from_the_environment_and_refused_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COEVOLVE_LABELS", "none")
    monkeypatch.setenv("COEVOLVE_D0_FILE", "elsewhere/d0.json")
    settings = load_settings(run_dir=str(tmp_path / "run"))
    assert settings.labels == "none"
    assert settings.d0.path(settings.run_dir) == (tmp_path / "run/elsewhere/d0.json").resolve()
    monkeypatch.setenv("COEVOLVE_LABELS", "some")
    with pytest.raises(ConfigError, match="labels"):
        load_settings(run_dir=str(tmp_path / "run"))


def test_up_with_no_labels_refuses_a_damaged_d0_before_starting_anything(
    tmp_path: Path, committed_d0: Path
) -> None:
    damaged = tmp_path / "d0.json"
    body = json.loads(committed_d0.read_text())
    body["tasks"][0]["user_turns"] = ["Sell every share I own."]  # edited after it was built
    damaged.write_text(json.dumps(body))
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    up = [sys.executable, "-m", "coevolve", "up", "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(
        [*up, "--labels", "none", "--d0", str(damaged), "--nats-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "sha256" in result.stderr and not (tmp_path / "run" / "nats").exists()
    wrong = subprocess.run(
        [*up, "--labels", "some"], env=env, capture_output=True, text=True, timeout=120
    )
    assert wrong.returncode == 2 and "--labels must be bfcl or none" in wrong.stderr


def test_the_explorer_is_told_which_calls_d0_covers_already(committed_d0: Path) -> None:
    start = start_tasks("bfcl")[0]
    d0 = load_d0(committed_d0)
    covered = [calls_of(task) for task in d0.tasks]
    goal = unguided_goal(start, covered)
    assert COVERED_NOTE in goal and covered[-1] in goal
    assert COVERED_NOTE not in unguided_goal(start)
    request = ExplorationRequest(task=start, covered=covered)
    decoded = msgspec.json.decode(msgspec.json.encode(request), type=ExplorationRequest)
    assert decoded.covered == covered
    # the same calls read the same, whatever the request says
    twin = msgspec.structs.replace(d0.tasks[0], user_turns=["Something else entirely."])
    other = next(task for task in d0.tasks if task.ground_truth != d0.tasks[0].ground_truth)
    assert calls_of(twin) == calls_of(d0.tasks[0]) and calls_of(twin) != calls_of(other)


def test_d0_is_built_with_its_own_role_model_unless_set_to_null(tmp_path: Path) -> None:
    settings = load_settings(run_dir=str(tmp_path / "run"))
    settings.services["llm"] = {"server": {"model": "qwen2.5-coder-0.5b-instruct", "n_ctx": 4096}}
    section = build_llm_section(settings)
    assert section["server"] == {"model": "qwen2.5-coder-1.5b-instruct", "n_ctx": 4096}
    assert settings.services["llm"]["server"]["model"] == "qwen2.5-coder-0.5b-instruct"
    settings.d0.role_model = None
    assert build_llm_section(settings)["server"]["model"] == "qwen2.5-coder-0.5b-instruct"
