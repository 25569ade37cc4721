"""distiller: draws experiences from rollout groups for navigated rollouts."""
