"""Self-attributing (AgentEvolver's step credit): the attributor role labels each step of a
rollout GOOD or BAD, and the learner adds a step-level advantage to the outcome's.

``steps``: which tokens and messages make a trajectory's steps; ``prompt``: what the
attributor is asked and how its answer is read; ``labeller``: labelling a group.
"""

from coevolve.shared.attribution.labeller import label_group, label_trajectory
from coevolve.shared.attribution.prompt import (
    StepVerdicts,
    attribution_messages,
    label_tokens,
    labels_of,
    labels_schema,
    parse_labels,
)
from coevolve.shared.attribution.steps import Step, labels_fit, policy_steps, step_spans

__all__ = [
    "Step",
    "StepVerdicts",
    "attribution_messages",
    "label_group",
    "label_tokens",
    "label_trajectory",
    "labels_fit",
    "labels_of",
    "labels_schema",
    "parse_labels",
    "policy_steps",
    "step_spans",
]
