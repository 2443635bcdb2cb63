"""The engines' tiers (vLLM), tested under each engine's own stack."""
