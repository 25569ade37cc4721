"""explorer service."""
