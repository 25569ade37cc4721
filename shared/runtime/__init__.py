"""What moves messages and runs processes: the bus and its subjects, the actor runtime,
the supervisor, the NATS server, credentials and permissions, telemetry, retries."""
