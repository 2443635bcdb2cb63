"""The tiered store and the session store over it, in process on real tiers."""
