"""The judge benchmark's labelled set: positives as BFCL has them, one corruption each."""

from __future__ import annotations

import itertools

from coevolve.bench.judge import ALL_CORRUPTIONS, labelled_set
from coevolve.shared.envs.bfcl.tasks import split_of


def test_each_negative_differs_from_its_positive_by_one_corruption() -> None:
    items, skipped = labelled_set(6, seed=3)
    positives = {i.task.id: i.task for i in items if i.positive}
    assert len(positives) == 6
    assert all(split_of(task.source_entry or task.id) == "train" for task in positives.values())
    negatives = [i for i in items if not i.positive]
    kinds = {i.kind for i in negatives}
    assert kinds <= set(ALL_CORRUPTIONS) and {"wrong_function", "other_description"} <= kinds
    assert len(negatives) + sum(skipped.values()) == 6 * len(ALL_CORRUPTIONS)
    for item in negatives:
        source = positives[item.source_id]
        task = item.task
        assert task.id != source.id and task.initial_state == source.initial_state
        before, after = source.ground_truth[0], task.ground_truth[0]
        if item.kind == "other_description":
            assert task.user_turns != source.user_turns and after == before
            assert item.note.startswith("query of multi_turn_base_")
            continue
        assert task.user_turns == source.user_turns
        if item.kind == "dropped_call":
            assert len(after) == len(before) - 1
        elif item.kind == "redundant_call":
            assert len(after) == len(before) + 1
            assert any(a == b for a, b in itertools.pairwise(after))
        else:
            assert len(after) == len(before)
            changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
            assert len(changed) == 1
            old, new = changed[0]
            if item.kind == "wrong_function":
                assert old.name != new.name
            else:
                assert old.name == new.name and old.arguments != new.arguments


def test_the_set_is_the_same_on_every_build() -> None:
    first, _ = labelled_set(4)
    second, _ = labelled_set(4)
    assert [(i.kind, i.task) for i in first] == [(i.kind, i.task) for i in second]
