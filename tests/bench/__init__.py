"""The benchmarks' quick modes."""
