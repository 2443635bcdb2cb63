"""Failure harnesses against real daemons: SIGKILL storms, soak, hostile clients, corruption, fuzzing."""
