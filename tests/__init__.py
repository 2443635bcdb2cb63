"""kvstore tests, grouped by wing."""
