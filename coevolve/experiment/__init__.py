"""The synthesis ablation experiment: run its arms, aggregate their results."""

from typing import Final

# no synthesis; unguided synthesis paced to coevolve's volume; signal-guided synthesis
SYNTHESIS_ARMS: Final = ("none", "random", "coevolve")
# the defaults (coevolve) with one of AgentEvolver's other mechanisms, or both:
# experiences in part of a group's prompts, step credit from the attributor
MECHANISM_ARMS: Final = ("navigate", "attribute", "both")
# the defaults with another learner objective: ETO's DPO of the expert against the
# target's failures; co-evolving DPO with its failure agent (docs/learning.md)
OBJECTIVE_ARMS: Final = ("eto", "coevolving_dpo")
# the no-label setting's upper reference: none's D0, plus BFCL's labelled train turns
# entering the pool at the pace and with the exposure synthesized tasks get
CONTROL_ARMS: Final = ("labelled_control",)
# self-navigating apart from synthesis: no explorer in either, the distiller on or off
NAVIGATION_ARMS: Final = ("navigate_off", "navigate_on")
ARMS: Final = (
    *SYNTHESIS_ARMS,
    *MECHANISM_ARMS,
    *OBJECTIVE_ARMS,
    *CONTROL_ARMS,
    *NAVIGATION_ARMS,
)
