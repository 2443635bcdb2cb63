"""How bytes travel: framing, carriers, arenas, cross-memory writes."""
