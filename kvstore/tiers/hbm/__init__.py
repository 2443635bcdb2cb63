"""The HBM tier: one device arena, its extent allocator, and the staging lanes into it."""
