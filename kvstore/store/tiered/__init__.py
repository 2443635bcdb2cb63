"""Chunk blobs across tiers ordered fast to slow: writes, batch reads, moves up and down."""
