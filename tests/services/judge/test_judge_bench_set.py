"""The judge benchmark's labelled set: positives as BFCL has them, one corruption each."""

from __future__ import annotations

import itertools

from coevolve.bench.judge import (
    ALL_CORRUPTIONS,
    INTENT_GRID,
    deterministic_pass,
    deterministic_stages,
    fit_intent_threshold,
    labelled_set,
    with_intent_threshold,
)
from coevolve.shared.envs.bfcl.tasks import split_of
from coevolve.shared.wording import name_words


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
        if item.kind == "written_as_call":
            assert after == before and before[0].name in task.user_turns[0]
            continue
        if item.kind == "about_the_call":
            assert after == before and task.user_turns != source.user_turns
            continue
        if item.kind == "template_request":
            assert after == before and task.user_turns != source.user_turns
            assert task.user_turns[0].startswith(" ".join(name_words(before[0].name)) + ": ")
            continue
        if item.kind == "role_swap":
            old, new = task.lineage.replaced or []
            assert task.lineage.parent_request == source.user_turns[0]
            assert old in source.user_turns[0] and old in task.user_turns[0]
            assert new in task.user_turns[0] and new not in source.user_turns[0]
            assert [c.name for c in after] == [c.name for c in before]
            assert any(new in c.arguments.values() for c in after)
            assert not any(old in c.arguments.values() for c in after)
            continue
        if item.kind == "unused_value":
            assert after == before and task.user_turns[0].startswith(source.user_turns[0])
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
            if item.kind in ("wrong_function", "opposite_function"):
                assert old.name != new.name
            else:
                assert old.name == new.name and old.arguments != new.arguments


def test_the_set_is_the_same_on_every_build() -> None:
    first, _ = labelled_set(4)
    second, _ = labelled_set(4)
    assert [(i.kind, i.task) for i in first] == [(i.kind, i.task) for i in second]


def test_the_errors_synthesis_made_are_in_the_set_and_rejected() -> None:
    """Each new kind applies to some turns and the judge's deterministic stages reject it."""
    items, _ = labelled_set(12, seed=5)
    kinds = {
        "written_as_call",
        "opposite_function",
        "unused_value",
        "about_the_call",
        "template_request",
    }
    made = [i for i in items if i.kind in kinds]
    assert {i.kind for i in made} == kinds
    for item in made:
        outcome = deterministic_stages(item, "ngram")
        assert not deterministic_pass(outcome), (item.kind, item.note, outcome.passed)


def test_the_intent_threshold_is_fitted_on_the_given_half_only() -> None:
    items, _ = labelled_set(8, seed=3)
    outcomes = [deterministic_stages(item, "ngram") for item in items]
    positives = [o for o in outcomes if o.item.positive]
    # the highest score any positive needs: everything at or below it passes that check
    strict = fit_intent_threshold(outcomes, min_accept=1.0)
    lenient = fit_intent_threshold(outcomes, min_accept=0.0)
    assert lenient == max(INTENT_GRID) and strict <= lenient
    for outcome in positives:
        at_strict = with_intent_threshold(outcome, strict)
        assert at_strict.passed["intent_matches"] == (outcome.intent_score >= strict)
    passing = [deterministic_pass(with_intent_threshold(o, strict)) for o in positives]
    if strict > min(INTENT_GRID):
        assert all(passing)
    # a threshold no turn reaches rejects every positive's relevance
    assert not any(
        with_intent_threshold(o, 1.01).passed["relevance"]
        for o in positives
        if o.intent_score < 1.0
    )
