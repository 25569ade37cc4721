"""Schedules that run the services' work in one process, in a fixed order: the baselines
the asynchronous services are measured against. Each calls the services' own handlers
and reads their configuration sections."""
