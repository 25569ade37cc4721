"""abstractor service."""
