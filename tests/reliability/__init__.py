"""Crashes, corruption, fuzzing, hostile clients, isolation, storms and soak."""
