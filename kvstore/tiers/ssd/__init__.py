"""The ssd tier: values in LMDB, its record framing, batch reads, space, checks and repair."""
