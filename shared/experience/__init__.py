"""Self-navigating (AgentEvolver's): experiences distilled from rollout groups, retrieved
for similar tasks and put into part of a group's prompts.

``prompt``: what the distiller role is asked and how its answer is read; ``retrieval``:
which stored experiences suit a task; ``guidance``: how experiences enter a prompt and
leave the training sample.
"""

from coevolve.shared.experience.guidance import guidance_text, with_guidance
from coevolve.shared.experience.prompt import (
    distil_messages,
    insight_schema,
    parse_insight,
)
from coevolve.shared.experience.retrieval import rank_experiences, task_request

__all__ = [
    "distil_messages",
    "guidance_text",
    "insight_schema",
    "parse_insight",
    "rank_experiences",
    "task_request",
    "with_guidance",
]
