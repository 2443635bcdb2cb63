"""Many agents sharing prefixes through one daemon for minutes: hit rates, bytes, latency."""
