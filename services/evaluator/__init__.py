"""evaluator: scores announced policy versions on held-out turns (optional)."""
