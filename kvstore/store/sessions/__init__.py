"""Sessions over the tiered store: the index, ownership, saves, reads, layouts, sharing."""
