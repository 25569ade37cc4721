"""The explorer's settings (the ``services.explorer`` section)."""

from __future__ import annotations

from typing import Literal

import msgspec

# settings that count or wait: none may be negative
NON_NEGATIVE = (
    "substitution_rounds",
    "parent_cooldown_versions",
    "state_variation_rounds",
    "sibling_parents",
    "composition_rounds",
    "discover_when_idle_s",
    "max_parent_depth",
)


class ExplorerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # rounds per signal, each from the parent turn's state and each first calling a
    # function the policy got wrong, with other values than the rounds before: each round
    # can give one candidate (a variant); a second step can use what the first returned
    rounds: int = 3
    # a signal aimed at a failure first gives at most this many variant turns by
    # substitution (``substitution.py``): the parent turn's calls and its request with one
    # value the user gave swapped for another the state holds; no LLM explores them, and
    # no LLM writes a request the parent's request states. 0: none
    substitution_rounds: int = 1
    # a signal aimed at a failure also gives at most this many composed turns
    # (``composition.py``): its turn, or a variant of it, joined with the turn before it,
    # or with a task of the pool that starts on the same state. 0: none. None: 1 with
    # labels (with 2, run 35's 20 children came from 10 parents and queued for their
    # first rollout), 3 with labels none (D0's argument-free lookups give no substitution
    # and no state variant with another request: in run 41, 9 of 26 children composed)
    composition_rounds: int | None = None
    # a signal aimed at a failure also varies (substitution and composition, as above) up
    # to this many other unsynthesized turns of the pool that call a function it got
    # wrong: with its own turn alone, runs 32-33 drew their 15-18 children from 7-8
    # parents, as signals come from the few turns rolled out (10 of 20 in run 35 with 1).
    # 0: the signal's turn alone
    sibling_parents: int = 2
    # a signal aimed at a failure also gives at most this many state variants
    # (``state_variation.py``): the parent's turn on another initial state, its numbers
    # scaled and its ids renamed, its calls replayed with the real classes. 0: none
    state_variation_rounds: int = 1
    # where the parent turn gives no substitution, explore with the LLM (``rounds``
    # rounds, requests written by the abstractor's LLM). Off: by hand, 1 of run 28's 11
    # accepted LLM-written tasks read as a user's request (docs/main-job.md)
    explore_without_substitution: bool = False
    max_steps: int = 2
    max_request_rounds: int = 8
    summary_max_tokens: int = 400
    # ask the summarizer for a signal whose failed calls code already found: the aimed
    # goal holds the conversation, the failed calls and the state without it; the summary
    # took 29-48 s of each exploration under load (runs 19-20, 2 cores)
    summarize_aimed: bool = False
    action_max_tokens: int = 96
    on_context_rejection: Literal["explore", "drop"] = "explore"
    history_messages: int = 12
    concurrency: int = 1
    # aim at the failure: explore a signal only when its trajectory got a ground-truth call
    # wrong (shared/failures.py); the exploration's first step of each round calls one of
    # those functions. false: every signal is explored, as the paper's loop does
    require_failure: bool = True
    # a signal whose turn was varied for a signal of a policy at most this many versions
    # older is not varied again (``recently_varied``): the children made then answer it.
    # Without it 18 children came from 8 parents, up to 6 a signal, and waited a median
    # of 5 versions for their first rollout (docs/main-job.md, run 32). 0: no cooldown
    parent_cooldown_versions: int = 4
    # explore signals of tasks at most this many synthesis generations from a seed task
    # (a seed task is 0): 0 explores only seed tasks' signals, so children stay variants of
    # the labelled turns instead of drifting through children of children
    max_parent_depth: int = 0
    # a signal on a task deeper than max_parent_depth (a child the policy failed) is
    # repaired from seed turns instead: sibling parents (sibling_parents of them) that
    # call a function it got wrong, the child's own seed among them. In run 40 (no labels)
    # half of the 44 signals were on children and dropped, and 18 children came from 5
    # parents. None: with labels none only (the labelled default was measured without)
    repair_children_from_seeds: bool | None = None
    # with labels: none, an explorer that no signal or request kept busy for this many
    # seconds explores the environment's next start state unguided (as `coevolve
    # discover` does), told which calls the pool's discovered tasks make: discovery goes
    # on beside training after D0's first tasks (d0.first_tasks), until the pool holds
    # d0.tasks discovered tasks; a whole D0 (committed or given) gets none. 0: off
    discover_when_idle_s: float = 30.0
    # each published exploration as one JSON line in RUN_DIR/<record>-<pid>.jsonl: what
    # synthesis was given, to run through abstractor and judge again offline (null: none)
    record: str | None = "explorer/explorations"

    def composition_limit(self, labelled: bool) -> int:
        """``composition_rounds``, its default resolved for a run with or without labels."""
        if self.composition_rounds is not None:
            return self.composition_rounds
        return 1 if labelled else 3

    def __post_init__(self) -> None:
        for name in NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and not value >= 0:  # not ``< 0``: a NaN seconds value fails too
                raise ValueError(f"{name} must be >= 0, got {value}")
