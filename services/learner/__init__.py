"""The GRPO learner: training core."""
