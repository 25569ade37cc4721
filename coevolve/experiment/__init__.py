"""The synthesis ablation experiment: run its arms, aggregate their results."""
