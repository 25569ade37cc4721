"""What actors share: messages, subjects, bus, runtime, telemetry, config, envs, models."""
