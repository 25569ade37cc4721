"""Which stored experiences suit a task: the most similar requests of its environment.

Similarity is the n-gram cosine of ``shared/similarity.py`` between the task's request
and each experience's (word 1-2 grams and character 4-grams): it needs no model, and
requests of the same kind share their wording ("move the file ... to ...").
"""

from __future__ import annotations

from collections.abc import Sequence

from coevolve.shared.messages import Experience, Task
from coevolve.shared.similarity import NearDuplicateIndex


def task_request(task: Task) -> str:
    """The text retrieval matches on: the task's user turns."""
    return "\n".join(task.user_turns)


def rank_experiences(
    task: Task, experiences: Sequence[Experience], top_k: int, min_similarity: float
) -> list[tuple[float, Experience]]:
    """Up to ``top_k`` experiences of the task's environment whose request is at least
    ``min_similarity`` like the task's, most similar first; one per distinct text."""
    candidates = [e for e in experiences if e.environment == task.environment]
    if not candidates or top_k < 1:
        return []
    index = NearDuplicateIndex([e.request for e in candidates], backend="ngram")
    scored = sorted(
        zip(index.similarities(task_request(task)), candidates, strict=True),
        key=lambda pair: (-pair[0], -pair[1].created_at),
    )
    chosen: list[tuple[float, Experience]] = []
    seen: set[str] = set()
    for similarity, experience in scored:
        if similarity < min_similarity or len(chosen) == top_k:
            break
        if experience.text in seen:
            continue
        seen.add(experience.text)
        chosen.append((similarity, experience))
    return chosen
