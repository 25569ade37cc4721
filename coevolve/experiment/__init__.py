"""The synthesis ablation experiment: run its arms, aggregate their results."""

from typing import Final

# no synthesis; unguided synthesis paced to coevolve's volume; signal-guided synthesis
ARMS: Final = ("none", "random", "coevolve")
