"""signal_monitor service."""
