"""kvstore as vLLM's secondary KV tier beside vLLM's own fs tier, in one harness."""
