"""Short single-turn BFCL tasks over a few MathAPI functions, for CPU-sized learning runs.

BFCL's multi-turn prompts carry every function of several API classes (2.4k-5.8k tokens),
which makes one learning step on two CPU cores cost about a minute. These tasks are of the
kind the explorer and abstractor synthesize for the pool: one user turn, the ground-truth
calls, in the real BFCL environment with BFCL's own checker, over one small stateless class
(MathAPI). Only the functions the tasks use are rendered as tools (every other MathAPI
function is held back with the environment's own ``missed_function`` mechanism, keyed to a
turn the task never reaches), which keeps prompts near 600 tokens. Each task is validated by
replaying its ground truth: it must score 1.0.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.catalog import function_docs
from coevolve.shared.messages import Task, ToolCall

API_CLASS = "MathAPI"
OFFERED = ("add", "subtract", "multiply", "divide", "max_value", "min_value")


def _pair(rng: random.Random) -> dict[str, object]:
    return {"a": rng.randint(2, 999), "b": rng.randint(2, 999)}


def _divisible(rng: random.Random) -> dict[str, object]:
    b = rng.randint(2, 40)
    return {"a": b * rng.randint(2, 60), "b": b}


def _numbers(rng: random.Random) -> dict[str, object]:
    return {"numbers": [rng.randint(1, 500) for _ in range(rng.randint(3, 5))]}


PHRASINGS: dict[str, tuple[str, ...]] = {
    "add": ("What is {a} plus {b}?", "Add {a} and {b}.", "Compute the sum of {a} and {b}."),
    "subtract": ("What is {a} minus {b}?", "Subtract {b} from {a}.", "Take {b} away from {a}."),
    "multiply": (
        "What is {a} times {b}?",
        "Multiply {a} by {b}.",
        "Compute the product of {a} and {b}.",
    ),
    "divide": ("What is {a} divided by {b}?", "Divide {a} by {b}.", "How much is {a} over {b}?"),
    "max_value": ("Which is the largest of {numbers}?", "Find the maximum of {numbers}."),
    "min_value": ("Which is the smallest of {numbers}?", "Find the minimum of {numbers}."),
}
ARGUMENTS: dict[str, Callable[[random.Random], dict[str, object]]] = {
    "add": _pair,
    "subtract": _pair,
    "multiply": _pair,
    "divide": _divisible,
    "max_value": _numbers,
    "min_value": _numbers,
}


def _render(text: str, arguments: dict[str, object]) -> str:
    shown = {
        key: ", ".join(str(v) for v in value) if isinstance(value, list) else value
        for key, value in arguments.items()
    }
    return text.format(**shown)


def make_task(task_id: str, question: str, function: str, arguments: dict[str, object]) -> Task:
    hidden = [doc.name for doc in function_docs(API_CLASS) if doc.name not in OFFERED]
    return Task(
        id=task_id,
        environment="bfcl",
        user_turns=[question],
        initial_state={},
        ground_truth=[[ToolCall(name=function, arguments=dict(arguments))]],
        env_config={
            "category": "synthesized",
            "involved_classes": [API_CLASS],
            "long_context": False,
            # turn 1 never comes in a one-turn task: these functions stay out of the prompt
            "missed_function": {"1": hidden},
        },
        origin="synthesized",
        source_entry=None,
        created_at=0.0,
    )


def replay_score(task: Task) -> float:
    """Score of the ground truth played as an agent would: the calls, then a closing reply."""
    from coevolve.shared.toolcalls import format_tool_calls

    env = make_environment("bfcl")
    try:
        env.reset(task)
        for calls in task.ground_truth:
            env.step(format_tool_calls(calls))
            env.step("Done.")
        return float(env.score())
    finally:
        env.close()


def build_tasks(count: int, seed: int, prefix: str) -> list[Task]:
    """``count`` tasks cycling through the offered functions, each validated by replay."""
    rng = random.Random(seed)
    tasks: list[Task] = []
    index = 0
    while len(tasks) < count:
        function = OFFERED[index % len(OFFERED)]
        phrasing = rng.choice(PHRASINGS[function])
        arguments = ARGUMENTS[function](rng)
        task = make_task(f"{prefix}_{index}", _render(phrasing, arguments), function, arguments)
        index += 1
        if replay_score(task) == 1.0:
            tasks.append(task)
    return tasks


def train_and_heldout(train: int, heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Disjoint task sets from different random draws (same functions, new numbers)."""
    train_tasks = build_tasks(train, seed, "math_train")
    questions = {t.user_turns[0] for t in train_tasks}
    heldout_tasks = [
        t
        for t in build_tasks(heldout * 2, seed + 10_000, "math_heldout")
        if t.user_turns[0] not in questions
    ][:heldout]
    return train_tasks, heldout_tasks
