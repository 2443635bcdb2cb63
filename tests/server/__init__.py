"""The daemon: its front ends, checks, auth, config, health and CLI, on real ports."""
